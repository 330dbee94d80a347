"""Weight-only int8 and int4 quantization for drafters (CPU): the drafter's decoding step reads half
(int8) or a quarter (int4, :class:`Int4Linear`, the default) of bf16's bytes.

Why only the drafter: speculative decoding stays lossless whatever the drafter computes, as long as
the probabilities it reports are those it sampled from; the target's weights must stay exact (its
greedy output must equal the target alone). On a CPU a one-token decoding step is bound by memory
bandwidth: on a 2-vCPU AMX Xeon (torch 2.13, qwen2.5-coder-0.5b in bf16) ~75% of a step is the
matmuls reading weights from DRAM. ``torch.ops.aten._weight_int8pack_mm`` (int8 weights, one
scale per output row, activations in the model's dtype) reads half of bf16's bytes and runs a
4864x896 projection in 0.35 ms instead of 0.61 ms with a working set larger than the caches.

It does not batch: its time grows with the number of rows (200 rows: 10.6 ms vs 1.0 ms for bf16
with AMX). So each quantized linear keeps the float weight too and picks per call: up to
``max_rows`` rows (the drafter's one-token steps, a few sessions drafting together) take the int8
kernel, more rows (prefills, syncs, wide batches) the float one. Memory: +50% over bf16 weights.

Limits: in bf16 the kernel needs ``in_features % 16 == 0`` (other widths crash or return NaN in
torch 2.13); such layers keep the float path, and every quantized layer is checked against
its dequantized weight on a random input before it is used.

Float32 drafters (CPUs without native bf16): the kernel's fp32-activation path is slow on some CPUs
(an AVX2-only AMD EPYC, a 4864x896 projection: 2.4 ms for 1 row, vs 0.52 ms for the fp32 layer on
oneDNN-packed weights), while its bf16-activation path takes 0.23 ms there. So an fp32 layer may run
the kernel on its input rounded to bf16 (``act_dtype``), converting the result back; which of the
two activation types is used, and whether int8 is used at all under ``auto``, is measured on the
model's largest layer at load (:func:`choose_fp32`). The drafts change a little, never the output.
"""

from __future__ import annotations

import torch
from torch import nn

MODES = ("auto", "none", "int8", "int4")
DEFAULT_MAX_ROWS = 4  # the int8 kernel's time grows with rows; it breaks even at ~4-8 rows (bf16, AMX)
INT4_MAX_ROWS = 8  # the int4 kernel breaks even with bf16 at ~10-12 rows (a whole qwen2.5-coder-0.5b step, AMX)
INT4_GROUP = 32  # int4: one scale and zero point per 32 weights of a row (64 drafts as fast, a little worse)


def available(mode: str = "int8") -> bool:
    if mode == "int4":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def parse_mode(x: str | None) -> str:
    from crossdraft.errors import InvalidArgument

    m = "auto" if x in (None, "") else str(x).strip().lower()
    if m not in MODES:
        raise InvalidArgument("quantize", f"must be one of {', '.join(MODES)}, got {x!r}")
    return m


def resolve_mode(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` -> ``int4`` for a CPU drafter computing in bf16/fp16 (``int8`` where this torch lacks the
    int4 kernel), else ``none``. For an fp32 CPU drafter, ``load_model`` then asks :func:`choose_fp32`
    whether int8 pays on this machine."""
    mode = parse_mode(mode)
    if mode == "auto":
        ok = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
        return "int4" if ok and available("int4") else "int8" if ok and available() else "none"
    if mode in ("int8", "int4"):
        from crossdraft.errors import InvalidArgument

        if not available(mode):
            kernel = "_weight_int8pack_mm" if mode == "int8" else "_weight_int4pack_mm_for_cpu"
            raise InvalidArgument("quantize", f"{mode} needs torch.ops.aten.{kernel} (not in this torch)")
        if torch.device(device).type != "cpu":
            raise InvalidArgument("quantize", f"{mode} weights are a CPU path; this model is on {device}")
    return mode


def _quantize_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w ~ q * scale[:, None]."""
    wf = w.detach().float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12).to(dtype)  # rounded to the compute dtype first,
    q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127)      # so q fits the scale the kernel uses
    return q.to(torch.int8).contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """A linear layer with an int8 copy of its weight, used for calls of at most ``max_rows`` rows.

    ``weight`` (and ``bias``) stay the original parameters, so code that reads ``.weight`` (a tied
    embedding, a pruned head's rows, cost estimates) sees the float model.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = DEFAULT_MAX_ROWS,
                 act_dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight, requires_grad=False)
        self.bias = bias
        self.in_features = int(weight.shape[1])
        self.out_features = int(weight.shape[0])
        self.max_rows = int(max_rows)
        # the kernel's activation dtype: the weight's, or bf16 for an fp32 layer (see the module doc)
        self.act_dtype = act_dtype or weight.dtype
        self._quantize()
        self.wide: nn.Module | None = None  # calls of more rows (e.g. crossdraft.models.cpulinear.PackedLinear)
        self.int8_calls = 0  # work counting for tests: how many calls took the low-bit kernel

    def _quantize(self) -> None:
        q, s = _quantize_rows(self.weight, self.act_dtype)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scales", s, persistent=False)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    @classmethod
    def from_linear(cls, lin: nn.Linear, max_rows: int = DEFAULT_MAX_ROWS,
                    act_dtype: torch.dtype | None = None) -> "Int8Linear":
        return cls(lin.weight, lin.bias, max_rows, act_dtype)

    def rows(self, idx: torch.Tensor) -> "Int8Linear":
        """The layer restricted to some output rows (a pruned LM head). Quantization is per row (int4:
        per group within a row), so the rows' low-bit copy equals the full layer's rows."""
        idx = idx.to(self.weight.device)
        w = self.weight.detach().index_select(0, idx).contiguous()
        bias = None if self.bias is None else self.bias.detach().index_select(0, idx)
        return type(self)(w, bias, self.max_rows, self.act_dtype)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // max(1, x.shape[-1])
        if 0 < rows <= self.max_rows and x.dtype == self.weight.dtype and x.device.type == "cpu":
            self.int8_calls += 1
            xk = x.reshape(rows, self.in_features).contiguous()
            y = self._mm(xk.to(self.act_dtype))
            y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if self.wide is not None:
            return self.wide(x)
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        act = "" if self.act_dtype == self.weight.dtype else f" ({self.act_dtype} activations)"
        bits = "int4" if isinstance(self, Int4Linear) else "int8"
        rows = f"{bits} up to {self.max_rows} rows{act}"
        return f"in_features={self.in_features}, out_features={self.out_features}, {rows}"


def _quantize_groups(w: torch.Tensor, dtype: torch.dtype, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group` weights along a row: w ~ (q - 8) * scale + zero with q in
    [0, 15] -- the form ``_weight_int4pack_mm_for_cpu`` computes. Returns q ([N, K] int32) and the
    scales and zeros ([K / group, N, 2] in `dtype`), rounded to `dtype` before q is chosen so that q
    fits the numbers the kernel uses."""
    n, k = w.shape
    wg = w.detach().float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8).to(dtype)
    zero = (lo + 8 * scale.float()).to(dtype)
    base = zero.float() - 8 * scale.float()  # the weight q = 0 stands for
    q = torch.round((wg - base[..., None]) / scale.float()[..., None]).clamp(0, 15)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()
    return q.to(torch.int32).reshape(n, k), sz


class Int4Linear(Int8Linear):
    """An :class:`Int8Linear` whose few-row calls read int4 weights (group-wise scales and zero points,
    ``INT4_GROUP`` weights a group): a quarter of bf16's bytes. On a 2-vCPU AMX Xeon a
    qwen2.5-coder-0.5b drafting step takes ~31 ms in int4 against ~51 in int8 and ~84 in bf16. The drafts
    change more than int8's (its argmax agrees with bf16's on ~9 tokens in 10, int8's on ~99 in 100); the
    output never does (the target verifies)."""

    def _padded(self) -> torch.Tensor:
        """The weight with zero rows up to a multiple of 16 outputs (the kernel's packing needs whole
        blocks of 16; a pruned head keeps any number of rows): their outputs are cut off."""
        w = self.weight.detach()
        pad = -w.shape[0] % 16
        return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w

    def _quantize(self) -> None:
        q, sz = _quantize_groups(self._padded(), self.act_dtype, INT4_GROUP)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), persistent=False)
        self.register_buffer("scales", sz, persistent=False)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, INT4_GROUP, self.scales)
        return y if y.shape[-1] == self.out_features else y[..., :self.out_features]

    def dequantized(self) -> torch.Tensor:
        q, sz = _quantize_groups(self.weight, self.act_dtype, INT4_GROUP)  # (rows are quantized alone)
        n, k = q.shape
        scale, zero = sz[..., 0].float().T, sz[..., 1].float().T  # [N, K / group]
        w = (q.reshape(n, k // INT4_GROUP, INT4_GROUP).float() - 8) * scale[..., None] + zero[..., None]
        return w.reshape(n, k)


def _supported(lin: nn.Linear, act_dtype: torch.dtype | None = None, bits: int = 8) -> bool:
    w = lin.weight
    if w.dim() != 2 or w.device.type != "cpu":
        return False
    if bits == 4:
        return w.shape[1] % INT4_GROUP == 0  # whole groups along a row
    if (act_dtype or w.dtype) != torch.float32 and w.shape[1] % 16:
        return False  # the bf16/fp16 kernel needs in_features % 16 == 0
    return True


@torch.inference_mode()
def _check(layer: Int8Linear) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, layer.in_features, generator=g).to(layer.act_dtype)
    got = layer._mm(x).float()
    want = x.float() @ layer.dequantized().T
    tol = 1e-2 * (want.abs().max().item() + 1.0)
    return bool(torch.isfinite(got).all()) and float((got - want).abs().max()) <= tol


def quantize_int8(model: nn.Module, max_rows: int | None = None, act_dtype: torch.dtype | None = None,
                  bits: int = 8) -> int:
    """Swap the decoder's linear layers and the LM head for :class:`Int8Linear` (``bits=4``:
    :class:`Int4Linear`) in place (``act_dtype``: the kernel's activations, default each layer's own dtype).
    Returns how many layers were swapped (layers the kernel cannot take keep their float path)."""
    mode = "int4" if bits == 4 else "int8"
    if not available(mode):
        raise RuntimeError(f"the {mode} kernel is not available in this torch")
    cls = Int4Linear if bits == 4 else Int8Linear
    if max_rows is None:
        max_rows = INT4_MAX_ROWS if bits == 4 else DEFAULT_MAX_ROWS
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or not _supported(child, act_dtype, bits):
                continue
            try:
                q = cls.from_linear(child, max_rows, act_dtype)
            except RuntimeError:  # a shape the kernel's packing refuses: the layer keeps its float path
                continue
            if not _check(q):
                continue
            setattr(parent, name, q)
            swapped += 1
    return swapped


def _best_pass(fns, xs, repeats: int = 3) -> float:
    """Seconds of the fastest of ``repeats`` passes calling every fn on its input."""
    import time

    best = float("inf")
    for r in range(repeats + 1):
        t = time.perf_counter()
        for f, x in zip(fns, xs, strict=True):
            f(x)
        if r:  # the first pass warms up
            best = min(best, time.perf_counter() - t)
    return best


PROBE_BYTES = 128 << 20  # timed layers' fp32 bytes: more than a CPU's caches, as in a real forward


def _probe_layers(model: nn.Module, group: int = 16) -> list[nn.Linear]:
    """The fp32 layers a load times kernels on: the first body layers in model order (~PROBE_BYTES) and
    up to 64 MB of the LM head's rows; only layers whose width is a multiple of `group`."""
    head = getattr(model, "lm_head", None)
    lins, size = [], 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (type(m) is nn.Linear and m is not head and w.dim() == 2 and w.dtype == torch.float32
                and w.device.type == "cpu" and w.shape[1] % group == 0):
            lins.append(m)
            size += w.numel() * 4
            if size >= PROBE_BYTES:
                break
    hw = getattr(head, "weight", None)
    if (type(head) is nn.Linear and hw is not None and hw.dim() == 2 and hw.dtype == torch.float32
            and hw.device.type == "cpu" and hw.shape[1] % group == 0):
        # every step reads the head too (a large share of a small drafter's bytes): its first rows
        # (up to 64 MB) stand in for it, so that timing stays ~1 s however wide the vocabulary
        n = max(16, min(hw.shape[0], (64 << 20) // (4 * hw.shape[1])))
        part = nn.Linear(hw.shape[1], n, bias=False)
        part.weight = nn.Parameter(hw.detach()[:n], requires_grad=False)
        lins.append(part)
    return lins


INT4_PAYS = 0.8  # int4 drafts a little worse than int8 (acceptance 0.705 vs 0.740, qwen pair): it must be faster


@torch.inference_mode()
def int4_pays_fp32(model: nn.Module, int8_act: torch.dtype) -> bool:
    """For an fp32 CPU model that int8 pays for (with activations ``int8_act``): whether int4 (bf16
    activations) runs the probe layers (:func:`_probe_layers`) at 1 and 2 rows in at most ``INT4_PAYS``
    of int8's time -- enough to pay for its less accurate drafts. Interleaved, the fastest of 5 rounds."""
    lins = _probe_layers(model, INT4_GROUP)
    if not lins or not available("int4"):
        return False
    try:
        variants = {"int8": [Int8Linear.from_linear(m, 2, int8_act) for m in lins],
                    "int4": [Int4Linear.from_linear(m, 2, torch.bfloat16) for m in lins]}
    except RuntimeError:  # a layer the int4 packing refuses
        return False
    if not _check(variants["int4"][0]):
        return False
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randn(r, m.in_features, generator=g) for m in lins] for r in (1, 2)]
    times = {k: float("inf") for k in variants}
    for _ in range(5):
        for k, fns in variants.items():
            times[k] = min(times[k], sum(_best_pass(fns, xs, repeats=1) for xs in rows))
    LAST_CHOICE.update(int4_ms=times["int4"] * 1e3, int8_probe_ms=times["int8"] * 1e3)
    return times["int4"] <= INT4_PAYS * times["int8"]


@torch.inference_mode()
def choose_fp32(model: nn.Module, required: bool = False, margin: float = 0.9) -> torch.dtype | None:
    """For an fp32 CPU model: the activation dtype (fp32 or bf16) with which the int8 kernel runs
    the model's body layers fastest at 1 and 2 rows -- if that beats the float layers
    (oneDNN-packed where available, crossdraft.models.cpulinear) by ``margin``, or in any case if
    ``required`` (``quantize="int8"`` asked for). None: int8 does not pay on this machine.

    Timed on the first body layers in model order (~128 MB of fp32 weights) and the LM head, one
    call each per pass:
    timing one layer over and over reads it from the CPU's caches, which flatters the float path
    (a 17 MB layer timed alone gives fp32-packed 0.64 ms vs int8 0.45, and half the runs are too
    close to call)."""
    from crossdraft.models import cpulinear

    lins = _probe_layers(model)
    if not lins or not available():
        return torch.float32 if required else None
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randn(r, m.in_features, generator=g) for m in lins] for r in (1, 2)]
    variants: dict = {"plain": [(lambda x, m=m: nn.functional.linear(x, m.weight, m.bias)) for m in lins]}
    if cpulinear.available():
        variants["packed"] = [cpulinear.PackedLinear(m) for m in lins]
    for act in (torch.float32, torch.bfloat16):
        qs = [Int8Linear.from_linear(m, max_rows=2, act_dtype=act) for m in lins]
        if _check(qs[0]):
            variants[act] = qs
    # interleaved passes (every variant once per round), the fastest round of each: a slow moment of
    # a shared machine then hits all variants alike
    times = {k: float("inf") for k in variants}
    for r in range(5):
        for k, fns in variants.items():
            times[k] = min(times[k], sum(_best_pass(fns, xs, repeats=1) for xs in rows))
        if r == 0:  # a variant far behind after the first round (the slow fp32-activation kernel) leaves
            lead = min(times.values())
            variants = {k: v for k, v in variants.items() if times[k] <= 2 * lead or not isinstance(k, torch.dtype)}
    float_s = min(times[k] for k in ("plain", "packed") if k in times)
    ints = {k: v for k, v in times.items() if isinstance(k, torch.dtype)}
    best = min(ints, key=ints.get) if ints else None
    best_s = ints[best] if best is not None else float("inf")
    LAST_CHOICE.update(float_ms=float_s * 1e3, int8_ms=best_s * 1e3, act=str(best))
    if required:
        return best or torch.float32
    if best is None or best_s > margin * float_s:
        return None
    return best


LAST_CHOICE: dict = {}  # the latest choose_fp32 timings (ms over the timed layers at 1 and 2 rows), for logs


def int8_calls(model: nn.Module) -> int:
    return sum(m.int8_calls for m in model.modules() if isinstance(m, Int8Linear))


def set_max_rows(model: nn.Module, max_rows: int) -> None:
    for m in model.modules():
        if isinstance(m, Int8Linear):
            m.max_rows = int(max_rows)
