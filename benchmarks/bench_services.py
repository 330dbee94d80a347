"""Benchmark: the distributed stack (Redis + drafter + verifier + gateway, all on 127.0.0.1) versus the
in-process Engine, side by side in one run, on the same model pair, dtype and HumanEval prompts.

What it reports, per path:

* per-round overhead -- the time of a round NOT spent in the drafter's or the verifier's forward
  passes (draft_s / verify_s / prefill_s are the forward times measured inside the model workers,
  identically for both paths), in two flavours:
    - in-loop: the round loop's own ``overhead_s`` (Engine ``Stats.overhead_s``; the gateway's
      ``overhead_ms``): mapping, bookkeeping and -- distributed -- the Draft/Verify RPCs (protobuf
      serialisation, loopback gRPC, the servers' context checks) and the round's trace span;
    - end-to-end: (client-observed wall time - prefill - draft - verify) / rounds, which adds what
      happens outside the round timer: tokenisation, session sync, the gateway's per-round Redis
      SET and delta streaming, the client's gRPC stream;
  and the overhead as a share of the mean round time;
* end-to-end tokens/s: completion tokens / wall time measured around ``Engine.generate`` and
  around the gRPC ``Client.generate`` call (plus one REST non-streaming row on prompt 0);
* greedy fidelity: the token ids of both paths are compared per prompt.

The paths alternate per prompt (A B, B A, A B, ...) so slow drift of a shared machine hits both
alike; one warm-up request per path runs first and is not counted. Distributed requests run in a
fresh gateway session each (so the per-round Redis save is included), deleted afterwards.

With ``--profile`` (default on) a Gateway object is also built inside this process, wired to the
same drafter/verifier services and Redis, and one request is timed with wrappers around the RPCs,
the context checks and the Redis save (``where the overhead goes``), then once under cProfile.

Usage: python benchmarks/bench_services.py [--target T] [--drafter D] [--dtype bfloat16] [--prompts 4]
                                           [--max-new-tokens 64] [--temperature 0] [--tag NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench import _cpu_name, git_commit, humaneval_prompts  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from crossdraft.decoding.sampling import SamplingParams  # noqa: E402
from crossdraft.engine import DraftConfig, Engine  # noqa: E402
from crossdraft.models import loading as M  # noqa: E402
from crossdraft.serving.redis_server import RedisServer  # noqa: E402
from tests.service_fixtures import Proc, free_port, gateway, wait_grpc_healthy, wait_http_ready  # noqa: E402

TARGET_OVERHEAD_MS = 1.0  # per round
TARGET_OVERHEAD_SHARE = 0.05  # of the round time
WARMUP_PROMPT = "def add(a, b):\n"


# ---- the stack ----------------------------------------------------------------------------------


def model_service(kind: str, model: str, log_dir: Path, dtype: str, threads: int) -> tuple[Proc, str]:
    """Like tests.service_fixtures.model_server, but with the same torch thread count as this process
    (the fixture pins OMP_NUM_THREADS=1, which would make the services' forwards slower)."""
    port = free_port()
    p = Proc(f"{kind}-{port}", [kind, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype],
             log_dir)
    p.env["OMP_NUM_THREADS"] = str(threads)
    return p.start(), f"127.0.0.1:{port}"


class Stack:
    def __init__(self, a, log_dir: Path, threads: int):
        self.a, self.log_dir, self.threads = a, log_dir, threads
        self.procs: list[Proc] = []
        self.redis = None

    def start(self):
        a = self.a
        self.redis = RedisServer().start()
        self.drafter, self.drafter_addr = model_service("drafter", a.drafter, self.log_dir, a.dtype, self.threads)
        self.procs.append(self.drafter)
        self.verifier, self.verifier_addr = model_service("verifier", a.target, self.log_dir, a.dtype, self.threads)
        self.procs.append(self.verifier)
        return self

    def wait(self):
        wait_grpc_healthy(self.drafter_addr, self.drafter, timeout=900)
        wait_grpc_healthy(self.verifier_addr, self.verifier, timeout=900)
        self.gw, self.http_url, self.grpc_addr = gateway(self.verifier_addr, self.drafter_addr, self.redis.url,
                                                         self.log_dir, drafter_timeout_s=self.a.drafter_timeout_s)
        self.procs.append(self.gw)
        wait_http_ready(self.http_url, self.gw, timeout=600)

    def stop(self):
        for p in reversed(self.procs):
            with contextlib.suppress(Exception):
                p.stop()
        if self.redis is not None:
            self.redis.stop()


# ---- one request per path ------------------------------------------------------------------------


def run_engine(engine: Engine, prompt: str, a, seed: int) -> dict:
    params = SamplingParams(temperature=a.temperature)
    t0 = time.perf_counter()
    res = engine.generate(prompt, max_new_tokens=a.max_new_tokens, params=params, seed=seed,
                          draft=DraftConfig(num_draft_tokens=a.num_draft_tokens))
    wall = time.perf_counter() - t0
    s = res.stats
    return row("in-process", res.token_ids, wall, rounds=s.rounds, draft_ms=s.draft_s * 1e3,
               verify_ms=s.verify_s * 1e3, prefill_ms=s.prefill_s * 1e3, overhead_ms=s.overhead_s * 1e3,
               total_ms=s.total_s * 1e3, drafted=s.drafted, accepted=s.accepted, text=res.text)


def run_grpc(client, prompt: str, a, seed: int) -> dict:
    opts = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=seed,
                num_draft_tokens=a.num_draft_tokens)
    sid = client.create_session(**opts)  # not timed: one SET, before the request
    try:
        t0 = time.perf_counter()
        c = client.generate(prompt, session_id=sid, **opts)
        wall = time.perf_counter() - t0
    finally:
        with contextlib.suppress(Exception):
            client.delete_session(sid)
    return row("distributed gRPC", c.token_ids, wall, text=c.text, **_stats(c.stats))


def run_rest(http_url: str, client, prompt: str, a, seed: int) -> dict:
    import requests

    opts = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=seed,
                num_draft_tokens=a.num_draft_tokens)
    sid = client.create_session(**opts)
    body = {"prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": a.temperature, "seed": seed,
            "num_draft_tokens": a.num_draft_tokens, "session_id": sid}
    try:
        t0 = time.perf_counter()
        r = requests.post(http_url + "/v1/completions", json=body, timeout=600)
        wall = time.perf_counter() - t0
        r.raise_for_status()
        d = r.json()
    finally:
        with contextlib.suppress(Exception):
            client.delete_session(sid)
    out = row("distributed REST", None, wall, text=d["choices"][0]["text"], **_stats(d["speculative"]))
    out["tokens"] = int(d["usage"]["completion_tokens"])
    out["tokens_per_s"] = out["tokens"] / wall
    return out


def _stats(st: dict) -> dict:
    f = lambda k: float(st.get(k, 0) or 0)  # noqa: E731  (MessageToDict may render numbers as strings)
    return dict(rounds=int(f("rounds")), draft_ms=f("draft_ms"), verify_ms=f("verify_ms"), prefill_ms=f("prefill_ms"),
                overhead_ms=f("overhead_ms"), total_ms=f("total_ms"), drafted=int(f("drafted")),
                accepted=int(f("accepted")), drafter_fallback=bool(st.get("drafter_fallback")),
                fallback_reason=st.get("fallback_reason", ""))


def row(path, token_ids, wall, **kw) -> dict:
    r = {"path": path, "token_ids": token_ids, "tokens": len(token_ids) if token_ids is not None else 0,
         "wall_s": wall, **kw}
    r["tokens_per_s"] = r["tokens"] / wall if wall > 0 else 0.0
    return r


# ---- aggregation ---------------------------------------------------------------------------------


def aggregate(runs: list[dict]) -> dict:
    if not runs:
        return {}
    tot = lambda k: sum(r[k] for r in runs)  # noqa: E731
    rounds = tot("rounds")
    wall_ms = tot("wall_s") * 1e3
    fwd = tot("draft_ms") + tot("verify_ms") + tot("prefill_ms")
    loop_ms = fwd + tot("overhead_ms")  # time inside the rounds
    e2e_over = wall_ms - fwd
    return {
        "prompts": len(runs), "tokens": tot("tokens"), "rounds": rounds, "wall_s": round(wall_ms / 1e3, 3),
        "tokens_per_s": round(tot("tokens") / (wall_ms / 1e3), 3),
        "tokens_per_round": round(tot("tokens") / rounds, 3),
        "acceptance_rate": round(tot("accepted") / tot("drafted"), 4) if tot("drafted") else 0.0,
        "draft_ms_per_round": round(tot("draft_ms") / rounds, 3),
        "verify_ms_per_round": round((tot("verify_ms") + tot("prefill_ms")) / rounds, 3),
        "round_ms": round(loop_ms / rounds, 3),
        "overhead_ms_per_round": round(tot("overhead_ms") / rounds, 4),
        "overhead_share": round(tot("overhead_ms") / loop_ms, 5) if loop_ms else 0.0,
        "e2e_overhead_ms_per_round": round(e2e_over / rounds, 4),
        "e2e_overhead_share": round(e2e_over / wall_ms, 5) if wall_ms else 0.0,
    }


def first_divergence(x: list[int], y: list[int]) -> int | None:
    if x == y:
        return None
    return next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))


# ---- where the gateway's overhead goes (in this process, same services) ---------------------------


def profile_gateway(stack: Stack, prompt: str, a, seed: int) -> dict:
    from crossdraft.serving import telemetry
    from gateway.config import GatewayConfig
    from gateway.server import build_gateway

    provider = telemetry.setup_tracing("crossdraft-gateway-bench", set_global=False)
    tracer = telemetry.get_tracer(provider, "crossdraft.gateway")
    cfg = GatewayConfig(verifier=stack.verifier_addr, drafter=stack.drafter_addr, redis_url=stack.redis.url,
                        connect_timeout_s=60, drafter_timeout_s=a.drafter_timeout_s)
    gw = build_gateway(cfg, tracer)
    opts = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, seed=seed,
                num_draft_tokens=a.num_draft_tokens)
    acc: dict[str, float] = {}

    def add(k, v):
        acc[k] = acc.get(k, 0.0) + v

    def wrap(obj, name, fn):
        orig = getattr(obj, name)

        def w(*args, **kw):
            return fn(orig, *args, **kw)

        setattr(obj, name, w)

    def draft(orig, *args, **kw):
        t0 = time.perf_counter()
        toks = orig(*args, **kw)
        dt = time.perf_counter() - t0
        add("draft_rpc_extra_ms", (dt - sum(t.forward_s for t in toks)) * 1e3)
        return toks

    def verify(orig, *args, **kw):
        t0 = time.perf_counter()
        r = orig(*args, **kw)
        add("verify_rpc_extra_ms", (time.perf_counter() - t0 - r.forward_s) * 1e3)
        return r

    def timed(key):
        def f(orig, *args, **kw):
            t0 = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                add(key, (time.perf_counter() - t0) * 1e3)
        return f

    from crossdraft.decoding.decode import Decoder

    # the clients the placement hands every session (one drafter and one verifier address here)
    d_client = gw.placement.any_client("drafter", 30.0)
    v_client = gw.placement.any_client("verifier", 30.0)
    wrap(d_client, "draft", draft)
    wrap(v_client, "verify", verify)
    orig_expect = Decoder._expect
    wrap(Decoder, "_expect", timed("context_crc_ms"))
    wrap(gw.store, "save", timed("redis_save_ms"))
    wrap(gw.metrics, "round", timed("metrics_ms"))
    from gateway.sessions import Session

    orig_to_json = Session.to_json
    wrap(Session, "to_json", timed("redis_save_ms_of_which_session_to_json"))

    def one(profiler=None):
        s = gw.create_session(dict(opts))
        job = gw.start(session_id=s.session_id, prompt=prompt, messages=None, options=dict(opts))
        t0 = time.perf_counter()
        evs = []
        if profiler:
            profiler.enable()
        try:
            for e in job.events():
                evs.append(e)
        finally:
            if profiler:
                profiler.disable()
        wall = time.perf_counter() - t0
        gw.delete_session(s.session_id)
        return evs[-1]["stats"], wall

    one()  # warm-up (channels, mask upload)
    acc.clear()
    st, wall = one()
    rounds = st["rounds"]
    per = {k: round(v / rounds, 4) for k, v in acc.items()}
    loop_over = st["overhead_ms"] / rounds
    inside = per.get("draft_rpc_extra_ms", 0) + per.get("verify_rpc_extra_ms", 0) + per.get("context_crc_ms", 0) \
        + per.get("metrics_ms", 0)
    per["rest_of_round_loop_ms"] = round(loop_over - inside, 4)  # mapping, bookkeeping, span, ...
    fwd = st["draft_ms"] + st["verify_ms"] + st["prefill_ms"]
    out = {"rounds": rounds, "in_loop_overhead_ms_per_round": round(loop_over, 4),
           "e2e_overhead_ms_per_round_in_process_gateway": round((wall * 1e3 - fwd) / rounds, 4),
           "breakdown_ms_per_round": per,
           "note": "Gateway core built inside the benchmark process against the same drafter/verifier/Redis; "
                   "*_rpc_extra = RPC wall time minus the forward time the server reports (serialisation, "
                   "loopback gRPC, span, server-side checks); redis_save happens between rounds, outside "
                   "the round timer."}
    prof = cProfile.Profile()
    one(prof)
    sio = io.StringIO()
    pstats.Stats(prof, stream=sio).sort_stats("tottime").print_stats(25)
    out["cprofile_top_tottime"] = sio.getvalue().splitlines()[:45]
    Session.to_json = orig_to_json
    Decoder._expect = orig_expect
    with contextlib.suppress(Exception):
        v_client.close()
        d_client.close()
    return out


# ---- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-draft-tokens", type=int, default=4, help="initial block size (the gateway's default is 4)")
    ap.add_argument("--drafter-timeout-s", type=float, default=120.0,
                    help="gateway deadline of one Draft call; past it the request goes on target-only (a loaded "
                         "machine must not silently turn the distributed path into target-only)")
    ap.add_argument("--no-rest", action="store_true", help="skip the REST non-streaming row")
    ap.add_argument("--no-profile", action="store_true", help="skip the in-process gateway breakdown / cProfile")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--log-dir", default=None, help="service logs (default: a temporary directory)")
    ap.add_argument("--tag", default="services")
    a = ap.parse_args()
    a.tag = result_name(a.tag)  # results are filed per machine class

    from crossdraft.client import Client

    prompts = humaneval_prompts(a.prompts)
    threads = torch.get_num_threads()
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="crossdraft-bench-services-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"service logs: {log_dir}", flush=True)
    stack = Stack(a, log_dir, threads)
    t0 = time.perf_counter()
    try:
        stack.start()
        dtype = M.parse_dtype(a.dtype)
        target = M.load_model(a.target, dtype=dtype)
        drafter = M.load_model(a.drafter, dtype=dtype, quantize="auto")  # as the drafter server (its default)
        engine = Engine(target, drafter)
        stack.wait()
        print(f"stack and in-process models ready in {time.perf_counter() - t0:.1f}s "
              f"(gRPC {stack.grpc_addr}, REST {stack.http_url})", flush=True)
        client = Client(stack.grpc_addr)

        # warm-up: one request per path, not counted
        w_a = run_engine(engine, WARMUP_PROMPT, a, 1)
        w_b = run_grpc(client, WARMUP_PROMPT, a, 1)
        print(f"warm-up: in-process {w_a['tokens_per_s']:.2f} tok/s, distributed {w_b['tokens_per_s']:.2f} tok/s",
              flush=True)

        results: list[dict] = []
        for pi, prompt in enumerate(prompts):
            seed = 1000 + pi
            order = ("A", "B") if pi % 2 == 0 else ("B", "A")
            got = {}
            for p in order:
                r = run_engine(engine, prompt, a, seed) if p == "A" else run_grpc(client, prompt, a, seed)
                r["prompt"], r["order"] = pi, "".join(order)
                got[p] = r
                print(f"  p{pi} {r['path']:18} {r['tokens']:3d} tok {r['wall_s']:6.2f}s {r['tokens_per_s']:6.2f} tok/s "
                      f"rounds {r['rounds']:3d} overhead {r['overhead_ms'] / r['rounds']:.3f} ms/round", flush=True)
            div = first_divergence(got["A"]["token_ids"], got["B"]["token_ids"])
            got["B"]["identical_to_in_process"] = div is None
            got["B"]["first_divergence"] = div
            results += [got["A"], got["B"]]

        rest = None
        if not a.no_rest:
            rest = run_rest(stack.http_url, client, prompts[0], a, 1000)
            ref = next(r for r in results if r["prompt"] == 0 and r["path"] == "in-process")
            rest["prompt"] = 0
            rest["identical_text_to_in_process"] = rest["text"] == ref["text"]
            print(f"  p0 distributed REST {rest['tokens']:3d} tok {rest['wall_s']:6.2f}s "
                  f"{rest['tokens_per_s']:6.2f} tok/s", flush=True)

        prof = None
        if not a.no_profile:
            print("profiling the gateway round path (in this process, same services) ...", flush=True)
            try:
                prof = profile_gateway(stack, prompts[0], a, 1000)
                print(json.dumps(prof["breakdown_ms_per_round"]), flush=True)
            except Exception as e:  # the breakdown is an extra: report, don't lose the main results
                prof = {"error": repr(e)[:500]}
                print(f"profile failed: {e!r}", flush=True)
        client.close()
        write_results(a, results, rest, prof, target, threads)
    finally:
        stack.stop()


def write_results(a, results, rest, prof, target, threads) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    A = [r for r in results if r["path"] == "in-process"]
    B = [r for r in results if r["path"] == "distributed gRPC"]
    sa, sb = aggregate(A), aggregate(B)
    same = sum(1 for r in B if r.get("identical_to_in_process"))
    diff = {
        "overhead_ms_per_round": round(sb["overhead_ms_per_round"] - sa["overhead_ms_per_round"], 4),
        "e2e_overhead_ms_per_round": round(sb["e2e_overhead_ms_per_round"] - sa["e2e_overhead_ms_per_round"], 4),
        "overhead_share": round(sb["overhead_share"] - sa["overhead_share"], 5),
        "e2e_overhead_share": round(sb["e2e_overhead_share"] - sa["e2e_overhead_share"], 5),
        "tokens_per_s_ratio": round(sb["tokens_per_s"] / sa["tokens_per_s"], 4) if sa["tokens_per_s"] else None,
    }
    met_loop = sb["overhead_ms_per_round"] <= TARGET_OVERHEAD_MS and sb["overhead_share"] <= TARGET_OVERHEAD_SHARE
    met_e2e = (sb["e2e_overhead_ms_per_round"] <= TARGET_OVERHEAD_MS
               and sb["e2e_overhead_share"] <= TARGET_OVERHEAD_SHARE)
    meta = {
        "tag": a.tag, "target": a.target, "drafter": a.drafter, "dtype": a.dtype, "prompts": len(A),
        "max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "num_draft_tokens": a.num_draft_tokens,
        "target_dtype_loaded": str(target.dtype), "torch_threads": threads,
        "services": "redis-server + drafter + verifier + gateway processes on 127.0.0.1, OMP_NUM_THREADS="
                    f"{threads} for the model services; one fresh gateway session per request",
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}", "cpu": _cpu_name(),
        **git_commit(),
        "target_overhead": f"<= {TARGET_OVERHEAD_MS} ms per round and <= {TARGET_OVERHEAD_SHARE:.0%} of the round time",
    }
    summary = {"in_process": sa, "distributed_grpc": sb, "distributed_minus_in_process": diff,
               "identical_token_ids": f"{same}/{len(B)}", "lossless": same == len(B),
               "target_met_in_loop": met_loop, "target_met_end_to_end": met_e2e}
    if rest:
        summary["distributed_rest_prompt0"] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rest.items()
                                               if k not in ("text",)}
        summary["distributed_rest_prompt0"].update(aggregate([rest]))
    runs = [{k: v for k, v in r.items() if k != "text"} for r in results]
    (out / f"{a.tag}.json").write_text(json.dumps({"meta": meta, "summary": summary, "gateway_profile": prof,
                                                   "runs": runs}, indent=1))

    def line(name, s, ident):
        return (f"| {name} | {s['tokens']} | {s['rounds']} | {s['tokens_per_round']:.2f} | {s['tokens_per_s']:.2f} | "
                f"{s['round_ms']:.1f} | {s['overhead_ms_per_round']:.3f} | {s['overhead_share']:.2%} | "
                f"{s['e2e_overhead_ms_per_round']:.3f} | {s['e2e_overhead_share']:.2%} | {ident} |")

    L = [f"# {a.tag}: distributed stack vs in-process engine", "",
         f"Target `{a.target}`, drafter `{a.drafter}`, {a.dtype}, {len(A)} HumanEval prompts, <= {a.max_new_tokens} "
         f"new tokens, temperature {a.temperature}, {threads} torch threads per model process. "
         f"Generated by `benchmarks/bench_services.py`.", "", "```", json.dumps(meta, indent=1), "```", "",
         "| path | tokens | rounds | tok/round | tok/s (e2e) | round ms | overhead ms/round (in loop) | share | "
         "overhead ms/round (e2e) | share | identical ids |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
         line("in-process Engine", sa, "reference"),
         line("distributed, gRPC client", sb, f"{same}/{len(B)}")]
    if rest:
        sr = aggregate([rest])
        L.append(line("distributed, REST non-streaming (prompt 0 only)", sr,
                      "text " + ("identical" if rest["identical_text_to_in_process"] else "DIFFERENT")))
    L += ["", f"**Cost of distribution** (distributed - in-process): {diff['overhead_ms_per_round']:+.3f} ms per round "
              f"in the round loop ({diff['overhead_share']:+.2%} of round time), "
              f"{diff['e2e_overhead_ms_per_round']:+.3f} ms per round end to end ({diff['e2e_overhead_share']:+.2%}); "
              f"throughput ratio distributed/in-process {diff['tokens_per_s_ratio']:.3f}.", ""]
    L += ["**What the numbers mean.** A round = one (possibly empty) drafter block + one verifier forward. "
          "`round ms` is the time inside the rounds (forwards + overhead) per round. *In-loop overhead* is the round "
          "loop's own time minus the drafter's and verifier's forward passes as measured inside the model workers "
          "(the same code measures both paths): in process that is token mapping and bookkeeping; distributed it "
          "adds the Draft and Verify RPCs (protobuf, loopback gRPC, the servers' context checks and handler "
          "threads) and the per-round trace span. *End-to-end overhead* = (client-observed wall - all forward time) "
          "/ rounds; it also counts what runs outside the round timer -- tokenisation, session sync, the gateway's "
          "per-round Redis SET, delta streaming and the client's gRPC stream -- amortised over the rounds. "
          "Tokens/s are completion tokens over client wall time (prefill included).", ""]
    verdict = []
    for name, ok, ms, share in (("in the round loop", met_loop, sb["overhead_ms_per_round"], sb["overhead_share"]),
                                ("end to end", met_e2e, sb["e2e_overhead_ms_per_round"], sb["e2e_overhead_share"])):
        verdict.append(f"{name}: {ms:.3f} ms/round, {share:.2%} of round time -> target "
                       f"{'MET' if ok else '**NOT met**'}")
    L += [f"**Target** (distributed overhead <= {TARGET_OVERHEAD_MS:g} ms per round and <= "
          f"{TARGET_OVERHEAD_SHARE:.0%} of the round time): " + "; ".join(verdict) + ".", ""]
    L += [f"**Fidelity.** Greedy token ids identical on {same}/{len(B)} prompts"
          + ("" if same == len(B) else " -- first divergence at "
             + ", ".join(f"p{r['prompt']}: token {r['first_divergence']}"
                         for r in B if not r['identical_to_in_process']))
          + ".", ""]
    fb = [r for r in B if r.get("drafter_fallback")]
    if fb or sa["rounds"] != sb["rounds"]:
        L += [f"**Caveat.** The two paths did not run the same rounds (in-process {sa['rounds']}, distributed "
              f"{sb['rounds']}); drafter fallbacks on the distributed path: {len(fb)}/{len(B)}"
              + (f" ({fb[0].get('fallback_reason', '')[:160]})" if fb else "")
              + ". Tokens/s are then not a like-for-like comparison; the per-round overheads still are.", ""]
    if prof and "breakdown_ms_per_round" in prof:
        L += ["**Where the distributed overhead goes** (gateway core run inside the benchmark process against the "
              f"same services, one request, {prof['rounds']} rounds; in-loop overhead "
              f"{prof['in_loop_overhead_ms_per_round']:.3f} ms/round):", "",
              "| part | ms per round |", "|---|---:|"]
        for k, v in prof["breakdown_ms_per_round"].items():
            L.append(f"| {k} | {v:.3f} |")
        L.append("")
    L += ["| prompt | order | in-process tok/s | distributed tok/s | in-process overhead ms/round | "
          "distributed overhead ms/round | identical |", "|---:|---|---:|---:|---:|---:|---|"]
    for ra, rb in zip(A, B, strict=True):
        L.append(f"| {ra['prompt']} | {ra['order']} | {ra['tokens_per_s']:.2f} | {rb['tokens_per_s']:.2f} | "
                 f"{ra['overhead_ms'] / ra['rounds']:.3f} | {rb['overhead_ms'] / rb['rounds']:.3f} | "
                 f"{'yes' if rb['identical_to_in_process'] else 'no (token %s)' % rb['first_divergence']} |")
    (out / f"{a.tag}.md").write_text("\n".join(L) + "\n")
    print(f"wrote {out / (a.tag + '.md')} and .json\n" + "\n".join(L), flush=True)


if __name__ == "__main__":
    main()
