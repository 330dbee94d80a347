"""GPU check of crossdraft.runtime.graphs: bucketed CUDA-graph forwards against eager ones, right and fast.

A random-initialised Qwen2.5-0.5B-shaped model on one GPU; two KV pools with the same sessions
(histories of 100-700 tokens); rounds of verification blocks (1-9 tokens per session, rejected
drafts rolled back) run once eagerly and once through ForwardGraphs (captured CUDA graphs). In
fp32 every row's logits must agree within 1e-4 (exit 1 if not: the fallback would have hidden a
wrong capture, so this is checked directly); then it times one batched verification step eagerly
and from the graph at B = 1, 8, 32 sessions in bf16 and prints the ratios.

    python benchmarks/gpu_graphs_check.py --out DIR               # CUDA
    python benchmarks/gpu_graphs_check.py --out DIR --cpu-smoke   # tiny fp32 model, emulated graphs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def build(smoke: bool, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if smoke:
        cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                          attn_implementation="sdpa")
    else:  # Qwen2.5-0.5B's shape
        cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                          tie_word_embeddings=True, attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(dtype).eval(), cfg


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from crossdraft.runtime.graphs import ForwardGraphs
    from crossdraft.runtime.kvpool import KVPool, Row, batched_forward

    device = "cpu" if args.cpu_smoke else "cuda"
    backend = "emulate" if args.cpu_smoke else "cuda"
    res = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    g = torch.Generator().manual_seed(1)

    # ---- fp32: graphs give the eager logits -----------------------------------------------------
    model, cfg = build(args.cpu_smoke, torch.float32, device)
    V = cfg.vocab_size
    pools = [KVPool(model, max_tokens=40_000, block_size=16) for _ in range(2)]
    fg = ForwardGraphs(model, pools[1], backend=backend)
    n_sess = 12
    seqs = [torch.randint(0, V, (int(n),), generator=g).tolist()
            for n in torch.randint(100, 700, (n_sess,), generator=g)]
    hs = [[p.alloc() for _ in seqs] for p in pools]
    for p, h in zip(pools, hs, strict=True):
        for i, s in enumerate(seqs):
            batched_forward(model, p, [Row(h[i], 0, s)])
    worst = 0.0
    for rnd in range(12):
        active = [i for i in range(n_sess) if (i * 7 + rnd) % 5 != 0][: 1 + rnd % n_sess]
        rows = [[], []]
        for i in active:
            back = min(3, rnd % 4)
            start = len(seqs[i]) - back
            seqs[i] = seqs[i][:start] + torch.randint(0, V, (1 + (i + rnd) % 9,), generator=g).tolist()
            for j in range(2):
                rows[j].append(Row(hs[j][i], start, seqs[i][start:], keep=len(seqs[i]) - start))
        eager = batched_forward(model, pools[0], rows[0])
        graph = batched_forward(model, pools[1], rows[1], graphs=fg)
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(eager, graph, strict=True)))
    st = fg.stats
    res["fp32"] = {"max_abs_diff": worst, "captures": st.captures, "replays": st.replays, "eager": st.eager,
                   "disabled": st.disabled}
    print("fp32", json.dumps(res["fp32"]), flush=True)
    ok = worst <= 1e-4 and not st.disabled and st.replays > 0
    del model, pools, fg
    if device == "cuda":
        torch.cuda.empty_cache()

    # ---- bf16: one verification step (9 tokens per session), eager vs graph ---------------------
    dtype = torch.float32 if args.cpu_smoke else torch.bfloat16
    model, cfg = build(args.cpu_smoke, dtype, device)
    pool = KVPool(model, max_tokens=64 * 640, block_size=16)
    fg = ForwardGraphs(model, pool, backend=backend)
    hs = [pool.alloc() for _ in range(32)]
    for h in hs:
        batched_forward(model, pool, [Row(h, 0, torch.randint(0, V, (512,), generator=g).tolist())])
    timing = {}
    reps = 3 if args.cpu_smoke else 30
    for B in (1, 8, 32):
        rows = [Row(h, 512, torch.randint(0, V, (9,), generator=g).tolist(), keep=9) for h in hs[:B]]
        t = {}
        for name, gr in (("eager", None), ("graph", fg)):
            for _ in range(3):  # warm-up (and the graph's capture and check)
                batched_forward(model, pool, rows, graphs=gr)
            ms = []
            for _ in range(reps):
                sync(device)
                t0 = time.perf_counter()
                batched_forward(model, pool, rows, graphs=gr)
                sync(device)
                ms.append((time.perf_counter() - t0) * 1e3)
            t[name] = statistics.median(ms)
        t["graph_speedup"] = t["eager"] / t["graph"]
        timing[B] = t
        print("bf16 B=%d" % B, json.dumps(t), flush=True)
    res["bf16_step_ms"] = timing
    res["bf16_graphs"] = {"captures": fg.stats.captures, "replays": fg.stats.replays, "disabled": fg.stats.disabled}
    res["ok"] = ok
    with open(os.path.join(args.out, "gpu_graphs_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("OK" if ok else "FAILED: graph replays differ from eager", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
