"""Measured forward costs: how long one forward of m tokens takes on this machine.

Whether drafting pays depends on three numbers: the drafter's cost per token, the target's cost
of one decoding step, and how much more the target's forward costs when it scores a block of m
tokens instead of one. The last one is where hardware differs most. On a GPU, or a CPU with
native bf16, a forward of 9 tokens costs about as much as one of 1 (memory-bound). On a CPU
computing in fp32 it does not: measured on a 2-vCPU Intel Xeon (AVX512, no bf16), torch 2.13,
Qwen2.5-Coder-1.5B: 1 token 324 ms, 3 tokens 324 ms, 5 tokens 644 ms, 9 tokens 893 ms (BLAS picks
a slower kernel beyond ~3 rows). A weight-bytes estimate cannot see that, so the model servers
time their own forwards once (at load; cached on disk per model, dtype, device, thread count
and CPU) and report the table; the draft-length policy reads costs from it.

Model servers on one machine's CPUs (``make run``, the benchmarks, a test) load and time their
models one at a time (:func:`cpu_startup_lock`, a lock file in the temporary directory): a drafter
timed while the verifier next to it was loading its weights once measured a one-token step at
815 ms instead of 37 ms, and a policy believing that never drafts.

``CROSSDRAFT_COST_PROFILE=static`` turns measuring off (the policy then uses the weight-bytes
estimate alone).

A table measured while the machine was busy (another process computing on the same cores) is too
slow everywhere, and a cached one would stick. So every start re-times a forward of one token (a
few forwards, well under a second): when it is clearly faster than the cached table says
(< ``RECHECK`` of it), the table is measured again and the cache keeps, size by size, the minimum
of the two -- busy moments only ever make forwards slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time

import torch

from crossdraft.models import attention

# tokens per forward that are timed; others are interpolated. The large sizes price what the small
# ones cannot: a batch of many sessions' blocks, and a drafter's catch-up on rounds it skipped (in
# text mode a Chinese character is 2-3 SmolLM2 tokens: a probe after 48 skipped rounds feeds ~150).
# Until 16/32/64 were timed, the table ended at 17 tokens and went on flat where its last steps were
# (bf16 on a CPU: 1..11 tokens cost about the same), pricing a 150-token catch-up as ~1 step, not ~4.
SIZES = (1, 2, 3, 4, 5, 6, 8, 11, 16, 32, 64)
VERIFIER_MAX = 64  # the table covers forwards of 1..VERIFIER_MAX tokens (beyond: the 32 -> 64 slope goes on)
# the drafter's table too: a batched drafting step runs B sessions' single tokens in one forward,
# and the policy prices it as a forward of B tokens (crossdraft.decoding.costmodel), a catch-up feed of n tokens
# as one of n
DRAFTER_MAX = 64
CONTEXT = 128  # tokens already cached when timing
RECHECK = 0.8  # re-measure when a start's one-token forward is this much faster than the cached table
_ENV = "CROSSDRAFT_COST_PROFILE"


@contextlib.contextmanager
def cpu_startup_lock(device, timeout_s: float = 600.0):
    """Hold the machine-wide lock of CPU model servers' heavy start (loading and timing a model).

    Only for CPU devices (a GPU server's timings do not suffer from another process's CPU work).
    After ``timeout_s`` without the lock the start goes on without it (a slow start, never a hang).
    Yields whether the lock is held."""
    if getattr(device, "type", str(device)) != "cpu":
        yield False
        return
    import fcntl
    import tempfile

    path = os.path.join(tempfile.gettempdir(), "crossdraft-cpu-startup.lock")
    try:
        f = open(path, "a+")
    except OSError:
        yield False
        return
    held = False
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError:
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.2)
        yield held
    finally:
        if held:
            fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def enabled() -> bool:
    return os.environ.get(_ENV, "measure").strip().lower() not in ("static", "off", "0", "no", "false")


def _sync(device) -> None:
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


@torch.inference_mode()
def measure(model, device, max_tokens: int, reps: int = 3) -> list[float]:
    """Milliseconds of one forward of m = 1..max_tokens tokens after CONTEXT cached tokens.

    Sizes in SIZES are timed (one warm-up, then the median of `reps`, interleaved so that a
    slow moment of a shared machine hits every size alike); the rest is interpolated linearly
    and the table made non-decreasing.
    """
    from crossdraft.runtime.sessions import crop_cache, new_cache

    vocab = int(model.get_input_embeddings().num_embeddings)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, min(vocab, 30000), (1, CONTEXT), generator=g).to(device)
    cache = new_cache(model)
    model(input_ids=ctx, position_ids=torch.arange(CONTEXT, device=device).unsqueeze(0), cache=cache,
          use_cache=True, logits_to_keep=1)
    sizes = [m for m in SIZES if m <= max_tokens] or [1]
    times: dict[int, list[float]] = {m: [] for m in sizes}
    for r in range(reps + 1):
        for m in sizes:
            x = torch.randint(0, min(vocab, 30000), (1, m), generator=g).to(device)
            pos = torch.arange(CONTEXT, CONTEXT + m, device=device).unsqueeze(0)
            _sync(device)
            t0 = time.perf_counter()
            model(input_ids=x, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=m)
            _sync(device)
            dt = time.perf_counter() - t0
            crop_cache(cache, CONTEXT)
            if r:  # the first pass warms every shape up
                times[m].append(dt * 1000.0)
    med = {m: statistics.median(v) for m, v in times.items()}
    out = []
    for m in range(1, max_tokens + 1):
        lo = max([s for s in sizes if s <= m], default=sizes[0])
        hi = min([s for s in sizes if s >= m], default=sizes[-1])
        if lo == hi:
            v = med[lo]
        else:
            v = med[lo] + (med[hi] - med[lo]) * (m - lo) / (hi - lo)
        if m > sizes[-1] and len(sizes) > 1:  # extrapolate from the last two timed sizes
            a, b = sizes[-2], sizes[-1]
            v = med[b] + max(0.0, (med[b] - med[a]) / (b - a)) * (m - b)
        out.append(v)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1])
    return [round(v, 3) for v in out]


@torch.inference_mode()
def quick_ms(model, device, reps: int = 3) -> float:
    """Median milliseconds of a one-token forward after CONTEXT cached tokens (one warm-up)."""
    from crossdraft.runtime.sessions import new_cache

    vocab = int(model.get_input_embeddings().num_embeddings)
    g = torch.Generator().manual_seed(1)
    ctx = torch.randint(0, min(vocab, 30000), (1, CONTEXT + reps + 1), generator=g).to(device)
    cache = new_cache(model)
    model(input_ids=ctx[:, :CONTEXT], position_ids=torch.arange(CONTEXT, device=device).unsqueeze(0), cache=cache,
          use_cache=True, logits_to_keep=1)
    out = []
    for i in range(reps + 1):
        p = CONTEXT + i
        _sync(device)
        t0 = time.perf_counter()
        model(input_ids=ctx[:, p:p + 1], position_ids=torch.tensor([[p]], device=device), cache=cache,
              use_cache=True, logits_to_keep=1)
        _sync(device)
        if i:
            out.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(out)


def _cache_key(loaded, max_tokens: int) -> str | None:
    path = getattr(loaded, "path", None)
    if path is None:
        return None  # an in-memory model (tests): nothing stable to key a cache on
    try:
        st = os.stat(path)
        ident = f"{path}|{st.st_size}|{int(st.st_mtime)}"
    except OSError:
        return None
    device = str(loaded.device)
    if device.startswith("cpu"):
        hardware = _cpu_name()
    elif device.startswith("cuda") and torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(loaded.device)
    else:
        hardware = device
    parts = [ident, str(loaded.dtype), device, torch.__version__, str(torch.get_num_threads()), hardware,
             str(SIZES), str(CONTEXT), str(max_tokens), f"gqa={int(attention.installed())}"]
    q = getattr(loaded, "quantize", "none")
    if q and q != "none":  # int8 weight copies change the small forwards' times (crossdraft.models.quant)
        parts.append(f"quantize={q}")
    act = getattr(loaded, "quantize_act", "")
    if act:  # an fp32 model's int8 layers: fp32 or bf16 activations
        parts.append(f"quantize_act={act}")
    lin = getattr(loaded, "cpu_linear", "plain")
    if lin and lin != "plain":  # oneDNN-packed weights change every forward's time (crossdraft.models.cpulinear)
        parts.append(f"cpu_linear={lin}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def forward_ms(loaded, max_tokens: int) -> list[float]:
    """The cost table of a loaded model (measured, or read from the on-disk cache); [] if disabled."""
    if not enabled():
        return []
    key = _cache_key(loaded, max_tokens)
    path = None
    if key is not None:
        from crossdraft.home import crossdraft_home

        path = crossdraft_home() / "costs" / f"{key}.json"
        cached = None
        try:
            data = json.loads(path.read_text())
            if isinstance(data.get("forward_ms"), list) and len(data["forward_ms"]) == max_tokens:
                cached = [float(x) for x in data["forward_ms"]]
        except (OSError, ValueError, AttributeError):
            pass
        if cached is not None:
            if quick_ms(loaded.model, loaded.device) >= RECHECK * cached[0]:
                return cached
            # the cached table was measured on a busy machine: measure again, keep the faster of each
            fresh = measure(loaded.model, loaded.device, max_tokens)
            table = [round(min(a, b), 3) for a, b in zip(cached, fresh, strict=True)]
            for i in range(1, len(table)):
                table[i] = max(table[i], table[i - 1])
            _write(path, loaded, table)
            return table
    table = measure(loaded.model, loaded.device, max_tokens)
    if path is not None:
        _write(path, loaded, table)
    return table


def _write(path, loaded, table: list[float]) -> None:
    """Store a table in the on-disk cache (atomically; a cache that cannot be written is skipped)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"model": str(getattr(loaded, "path", "")), "dtype": str(loaded.dtype),
                                   "device": str(loaded.device), "threads": torch.get_num_threads(),
                                   "cpu": _cpu_name(), "forward_ms": table}))
        tmp.replace(path)
    except OSError:
        pass
