"""GPU benchmark of the verifier's own serving path: C sessions verifying at once, batched or not.

Unlike gpu_verify_batch.py (one batched_forward call), this drives crossdraft.runtime.workers.VerifierWorker
exactly as the gRPC handlers do: C client threads, each with its own session (a 512-token history),
call ``verify`` with 8 drafts per round, round after round; the worker either batches their forwards
through its BatchScheduler and paged KV pool -- with its forwards replayed as CUDA graphs per shape
bucket (mode ``graphs``, the default on CUDA) or eagerly (``batched``) -- or runs one forward at a
time with a private cache per session (``unbatched``, the code before batching). Greedy,
random drafts (mostly rejected, so every round also rolls the cache back). Reports verifications/s
per C for both, their ratio, and the batched worker's mean rows per forward and queue wait.

    python benchmarks/gpu_worker_concurrency.py --out DIR              # CUDA, Llama-3-8B shape, bf16
    python benchmarks/gpu_worker_concurrency.py --out DIR --cpu-smoke  # tiny fp32 model on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402


@dataclass
class Loaded:
    """What a worker reads of crossdraft.models.loading.LoadedModel (no tokenizer needed to verify)."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset
    vocab_size: int


def run_point(worker, c: int, rounds: int, ctx: int, vocab: int, k: int) -> dict:
    from crossdraft.decoding.sampling import SamplingParams

    rng = np.random.default_rng(c)
    sids = [f"c{c}-s{i}" for i in range(c)]
    for sid in sids:  # history + prefill (first verify) outside the timed part
        worker.sync(sid, [int(x) for x in rng.integers(10, vocab - 10, size=ctx)])
        worker.verify(sid, None, [11], None, 0, SamplingParams(), 0)
    start = threading.Barrier(c + 1)
    errors = []

    def client(i):
        r = np.random.default_rng(100 + i)
        try:
            start.wait()
            for rnd in range(1, rounds + 1):
                drafts = [int(x) for x in r.integers(10, vocab - 10, size=k)]
                worker.verify(sids[i], None, drafts, None, rnd, SamplingParams(), 0)
        except BaseException as e:  # noqa: BLE001 - reported
            errors.append(repr(e))

    ts = [threading.Thread(target=client, args=(i,)) for i in range(c)]
    for t in ts:
        t.start()
    sched = getattr(worker, "scheduler", None)
    b0 = (sched.stats.batches, sched.stats.rows) if sched else (0, 0)
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    for sid in sids:
        worker.end(sid)
    out = {"clients": c, "rounds_per_client": rounds, "seconds": dt, "verifications_per_s": c * rounds / dt,
           "ms_per_round_per_client": dt / rounds * 1e3, "errors": errors[:3]}
    if sched:
        batches, rows = sched.stats.batches - b0[0], sched.stats.rows - b0[1]
        out["mean_rows_per_forward"] = rows / max(1, batches)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--clients", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--modes", default="graphs,batched,unbatched",
                    help="graphs: batched with CUDA graphs per shape bucket (crossdraft.runtime.graphs; "
                    "emulated on a CPU); "
                         "batched: batched, eager; unbatched: one forward at a time")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from benchmarks.gpu_verify_batch import build_model
    from crossdraft.runtime.batching import BatchConfig
    from crossdraft.runtime.workers import VerifierWorker, WorkerConfig

    model, cfg, device, dtype, tf_version = build_model(args.cpu_smoke)
    loaded = Loaded(model, None, "random-8b-shape" if not args.cpu_smoke else "tiny", device, dtype, frozenset(),
                    int(cfg.vocab_size))
    clients = [int(x) for x in args.clients.split(",")]
    if args.cpu_smoke:
        clients, args.rounds, args.context = [1, 4], 3, 64
    k = 8
    res = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": tf_version, "dtype": str(dtype), "context": args.context, "drafts_per_round": k,
           "modes": {}}
    for mode in args.modes.split(","):
        batch = None
        if mode in ("graphs", "batched"):
            batch = BatchConfig(max_rows=64, max_tokens=8192, cuda_graphs=mode == "graphs")
        w = VerifierWorker(loaded, WorkerConfig(max_sessions=128), batch=batch)
        pts = []
        run_point(w, 1, 2, args.context, loaded.vocab_size, k)  # warm-up
        for c in clients:
            p = run_point(w, c, args.rounds, args.context, loaded.vocab_size, k)
            print(mode, json.dumps(p), flush=True)
            pts.append(p)
        if w.scheduler is not None:
            g = w.scheduler.graphs
            if g is not None:
                st = g.stats
                res.setdefault("graphs", {}).update(captures=st.captures, replays=st.replays, eager=st.eager,
                                                    disabled=st.disabled,
                                                    buckets={str(k): v for k, v in st.buckets.items()})
                print("graphs", json.dumps(res["graphs"]), flush=True)
            w.scheduler.close()
        del w
        if device.type == "cuda":
            torch.cuda.empty_cache()
        res["modes"][mode] = pts
    vps = {m: {p["clients"]: p["verifications_per_s"] for p in pts} for m, pts in res["modes"].items()}
    ratios = {}
    if "batched" in vps and "unbatched" in vps:
        ratios["batched_vs_unbatched"] = {c: vps["batched"][c] / vps["unbatched"][c] for c in vps["batched"]}
    if "graphs" in vps and "batched" in vps:
        ratios["graphs_vs_batched"] = {c: vps["graphs"][c] / vps["batched"][c] for c in vps["graphs"]}
    for m in ("graphs", "batched"):
        if m in vps:
            ratios[f"{m}_vs_one_client"] = {c: vps[m][c] / vps[m][clients[0]] for c in vps[m]}
    res.update(ratios)
    print(json.dumps(ratios), flush=True)
    with open(os.path.join(args.out, "gpu_worker_concurrency.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
