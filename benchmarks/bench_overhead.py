"""Benchmark: a round's overhead through the whole stack, and where it goes.

The stack is real (Redis, a drafter and a verifier server, a gateway, each its own process on
127.0.0.1); one client sends REST requests one at a time (streamed and not), speculative and
target-only alternately, on the same prompts. The gateway writes its round log (--round-log): each
round's ``overhead_ms`` -- its wall time from the end of the request's previous round minus the
model time on its critical path (forwards and the servers' queue waits; crossdraft.decoding.decode
``Decoder._round``) -- and where it went (``overhead_parts_ms``):

* gap: before the round, the front end's handling of the previous round's event (span, metrics,
  streaming) until the round loop is asked for the next round;
* draft_rpc: the Draft call's wall time outside the drafter's steps (protobuf, gRPC, the drafter's
  own checks and edit), map: the block expressed in target ids;
* verify_rpc: the Verify call's wall time outside the verifier's time;
* loop: the rest of the round (policy, emission, the drafter's next edit, bookkeeping).

It reports the median (and mean, p90) per round of each, for rounds that drafted, speculative rounds
that drafted nothing, and target-only rounds, and writes benchmarks/results/<tag>-<machine>.json.

Usage: python benchmarks/bench_overhead.py [--target gemma3-270m] [--drafter smollm2-135m] [--modes serial,pipelined]
                                           [--prompts 6] [--max-new-tokens 64] [--tag overhead-tiny]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import requests  # noqa: E402
from bench import _cpu_name, git_commit, humaneval_prompts  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from tests.service_fixtures import Services  # noqa: E402

PROSE = ["The history of the printing press begins", "Photosynthesis is the process by which plants",
         "A good night's sleep matters because"]
SESSION = requests.Session()  # one keep-alive connection, as a client would hold
PARTS = ("gap", "draft_rpc", "map", "verify_rpc", "loop")


def request(http: str, prompt: str, a, use_drafter: bool, stream: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": 0, "use_drafter": use_drafter,
            "stream": stream}
    if use_drafter and a.fixed_k:  # every round drafts (the policy would stop drafting where it does not pay)
        body["adaptive_draft"] = False
    t0 = time.perf_counter()
    r = SESSION.post(f"{http}/v1/completions", json=body, stream=stream, timeout=600)
    r.raise_for_status()
    if not stream:
        st = r.json()["speculative"]
    else:
        st = None
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data: {"):
                st = json.loads(line[6:]).get("speculative") or st
    return {"wall_s": time.perf_counter() - t0, "stats": st}


def summarise(rows: list[dict]) -> dict:
    if not rows:
        return {"rounds": 0}
    over = [r["overhead_ms"] for r in rows]
    out = {"rounds": len(rows), "median_ms": round(statistics.median(over), 3),
           "mean_ms": round(statistics.fmean(over), 3),
           "p90_ms": round(sorted(over)[int(0.9 * (len(over) - 1))], 3),
           "parts_median_ms": {}, "parts_mean_ms": {}}
    for p in PARTS:
        xs = [r.get("overhead_parts_ms", {}).get(p, 0.0) for r in rows]
        out["parts_median_ms"][p] = round(statistics.median(xs), 3)
        out["parts_mean_ms"][p] = round(statistics.fmean(xs), 3)
    return out


def grpc_floor(addr: str, n: int = 40) -> dict:
    """The transport's own round trip: a trivial unary RPC to the verifier (GetVerifierInfo, answered from
    memory), median ms, called back to back and after the caller and the server idled 10 and 100 ms (a
    verification keeps both idle about that long, and waking idle threads is most of a call's cost)."""
    from crossdraft.serving import rpc
    from crossdraft.v1 import verifier_pb2, verifier_pb2_grpc

    stub = verifier_pb2_grpc.VerifierServiceStub(rpc.client_channel(addr))
    stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
    out = {}
    for gap in (0.0, 0.01, 0.1):
        xs = []
        for _ in range(n):
            time.sleep(gap)
            t0 = time.perf_counter()
            stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(), timeout=10)
            xs.append((time.perf_counter() - t0) * 1e3)
        out[f"idle_{int(gap * 1000)}ms"] = round(statistics.median(xs), 3)
    return out


def groups_of(log: Path) -> dict:
    """The round log's steady rounds (each request's first round -- prefill, syncs -- left out), summarised
    for rounds that drafted, speculative rounds that drafted nothing, and target-only rounds."""
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    rounds = [x for x in lines if "round" in x and "overhead_ms" in x]
    first: dict[str, int] = {}
    for x in rounds:
        first[x["sid"]] = min(first.get(x["sid"], x["round"]), x["round"])
    steady = [x for x in rounds if x["round"] != first[x["sid"]]]
    spec = {x["sid"] for x in lines if "start" in x}  # (the log's start lines are speculative requests')
    return {"drafting": summarise([x for x in steady if x["drafted"] > 0]),
            "speculative_not_drafting": summarise([x for x in steady if x["drafted"] == 0 and x["sid"] in spec]),
            "target_only": summarise([x for x in steady if x["sid"] not in spec])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--adaptive", dest="fixed_k", action="store_false",
                    help="speculative requests choose their draft lengths (default: fixed blocks of 4, so that every "
                         "speculative round drafts)")
    ap.add_argument("--modes", default="serial,pipelined", help="serial and/or pipelined rounds (--pipeline)")
    ap.add_argument("--gateway-arg", action="append", default=[], help="an extra gateway flag (repeatable)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="overhead-tiny")
    a = ap.parse_args()
    tag = result_name(a.tag)

    n_code = (a.prompts + 1) // 2
    prompts = humaneval_prompts(n_code) + PROSE[: a.prompts - n_code]
    logs = Path(tempfile.mkdtemp(prefix="crossdraft-bench-overhead-"))
    print(f"logs: {logs}", flush=True)
    modes = [m for m in a.modes.split(",") if m]
    per_mode = {}
    with Services(logs) as s:
        _, vaddr = s.verifier(a.target)
        _, daddr = s.drafter(a.drafter)
        s.ready()
        gateways = {}
        for mode in modes:  # one gateway per mode, on the same model servers
            log = logs / f"rounds-{mode}.jsonl"
            _, http, _ = s.gateway(vaddr, daddr, drafter_timeout_s=120,
                                   extra=["--round-log", str(log), "--pipeline", "on" if mode == "pipelined" else "off",
                                          *a.gateway_arg])
            gateways[mode] = (http, log)
        s.ready()
        floor = grpc_floor(vaddr)
        print(f"gRPC floor (the verifier's GetVerifierInfo, ms, by idle time before the call): {floor}", flush=True)
        for mode, (http, log) in gateways.items():
            for use in (True, False):  # warm-up, not counted
                request(http, "def add(a, b):\n", a, use, False)
            log.write_text("")
            for i, prompt in enumerate(prompts):
                for stream in (False, True):
                    order = (True, False) if (i + stream) % 2 == 0 else (False, True)
                    for use in order:
                        r = request(http, prompt, a, use, stream)
                        st = r["stats"] or {}
                        print(f"  {mode} p{i} {'spec' if use else 'target-only':11} {'stream' if stream else 'json  '} "
                              f"{st.get('rounds', 0):3d} rounds, overhead "
                              f"{st.get('overhead_ms', 0.0) / max(1, st.get('rounds', 1)):.3f} ms/round", flush=True)
        time.sleep(0.2)
    for mode, (_, log) in gateways.items():
        per_mode[mode] = groups_of(log)
        for k, v in per_mode[mode].items():
            if v["rounds"]:
                print(f"{mode:9} {k:26} {v['rounds']:4d} rounds  overhead median {v['median_ms']:.3f} ms  "
                      f"mean {v['mean_ms']:.3f}  p90 {v['p90_ms']:.3f}  parts (median) {v['parts_median_ms']}",
                      flush=True)
    result = {
        "benchmark": "overhead", "tag": tag, "target": a.target, "drafter": a.drafter,
        "max_new_tokens": a.max_new_tokens, "prompts": len(prompts), "clients": 1, "api": "REST (json and stream)",
        "python": platform.python_version(),
        "meta": {**git_commit(), "cpu": _cpu_name(), "machine": platform.node()},
        "gateway_args": a.gateway_arg, "fixed_k": a.fixed_k,
        "per_round": per_mode,
        "grpc_floor_ms": floor,
        "definition": "overhead_ms = the round's wall time from the end of the request's previous round minus the "
                      "model time on its critical path (forwards and the model servers' queue waits); the first "
                      "round of each request (prefill, syncs) is left out",
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out / f'{tag}.json'}")


if __name__ == "__main__":
    main()
