"""GPU microbenchmark: verify draft blocks of B sessions in ONE forward (crossdraft.runtime.kvpool).

A random-initialised Llama-3-8B-shaped model (bf16, sdpa) on one GPU; 64 sessions with 512-token
histories in a KVPool; a verification step = one batched_forward of B rows x 9 tokens (8 drafts +
1), keep=9, then every row truncated back (rollback). Reports ms per step, sessions/s and the
throughput ratio vs B=1; the batched-vs-one-by-one speedup at B=16, 32; and, at B=16, how far the
batched logits are from verifying each session alone (bf16: reported, not asserted).

    python benchmarks/gpu_verify_batch.py --out DIR          # CUDA, ~8B model
    python benchmarks/gpu_verify_batch.py --out DIR --cpu-smoke   # tiny fp32 model on CPU
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


def log(*a):
    print(*a, flush=True)


def build_model(smoke: bool, gpu_dtype: torch.dtype = torch.bfloat16):
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if smoke:
        cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                          rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                          attn_implementation="sdpa")
        device, dtype = torch.device("cuda"), gpu_dtype
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:  # parameters are created (and randomly initialised) directly on the target device
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=device, dtype=dtype).eval()
    return model, cfg, device, dtype, transformers.__version__


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for results.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny fp32 model on CPU (checks the script end to end)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                    help="GPU dtype (float32: tells bf16 rounding apart from a batching error in the check)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    from crossdraft.runtime.kvpool import KVPool, Row, batched_forward

    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --cpu-smoke to run on CPU)")
    if smoke:
        n_sessions, ctx, batches, check_b, seq_bs = 8, 64, [1, 2, 4, 8], 4, [4, 8]
        warmup, runs, seq_runs = 1, 3, 2
    else:
        n_sessions, ctx, batches, check_b, seq_bs = 64, 512, [1, 2, 4, 8, 16, 32, 64], 16, [16, 32]
        warmup, runs, seq_runs = 3, 10, 3
    k = 9  # 8 drafts + 1
    prefill_chunk = 8

    t0 = time.perf_counter()
    model, cfg, device, dtype, tf_version = build_model(smoke, getattr(torch, args.dtype))
    sync(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model built: {n_params / 1e9:.2f}B params, {dtype}, {device}, {time.perf_counter() - t0:.1f}s")
    dev_name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"

    pool = KVPool(model, max_tokens=n_sessions * (ctx + 16), block_size=16)
    log(f"pool: {pool}")
    g = torch.Generator().manual_seed(1)
    V = cfg.vocab_size
    hs = [pool.alloc() for _ in range(n_sessions)]
    hist = {h: torch.randint(0, V, (ctx,), generator=g).tolist() for h in hs}
    drafts = {h: torch.randint(0, V, (k,), generator=g).tolist() for h in hs}

    t0 = time.perf_counter()
    for i in range(0, n_sessions, prefill_chunk):
        batched_forward(model, pool, [Row(h, 0, hist[h]) for h in hs[i:i + prefill_chunk]])
    sync(device)
    prefill_s = time.perf_counter() - t0
    log(f"prefill: {n_sessions} x {ctx} tokens in {prefill_s:.2f}s; blocks used {pool.blocks_used}/{pool.blocks_total}")

    def step(handles):
        outs = batched_forward(model, pool, [Row(h, ctx, drafts[h], keep=k) for h in handles])
        for h in handles:
            pool.truncate(h, ctx)  # rollback: reject everything
        return outs

    def timed(fn, n_warm, n_runs):
        for _ in range(n_warm):
            fn()
        sync(device)
        ts = []
        for _ in range(n_runs):
            sync(device)
            t = time.perf_counter()
            fn()
            sync(device)
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts), ts

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_b = {}
    for B in batches:
        ms, ts = timed(lambda B=B: step(hs[:B]), warmup, runs)
        per_b[B] = {"ms_per_forward": ms, "sessions_per_s": B / ms * 1e3, "tokens_per_s": B * k / ms * 1e3,
                    "runs_ms": [round(x, 3) for x in ts]}
        log(f"B={B:3d}: {ms:8.2f} ms/forward  {B / ms * 1e3:9.1f} sessions/s")
    base = per_b[batches[0]]["sessions_per_s"]
    for B in batches:
        per_b[B]["throughput_vs_b1"] = per_b[B]["sessions_per_s"] / base

    # correctness on the device: batched rows vs each session verified alone
    batched = [o.clone() for o in step(hs[:check_b])]
    alone = [step([h])[0].clone() for h in hs[:check_b]]
    diffs = [(a - b).abs().max().item() for a, b in zip(batched, alone, strict=True)]
    agree = [bool((a.argmax(-1) == b.argmax(-1)).all()) for a, b in zip(batched, alone, strict=True)]
    n_pos_agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(batched, alone, strict=True))
    logit_scale = max(o.abs().max().item() for o in alone)
    check = {"B": check_b, "max_abs_diff": max(diffs), "per_row_max_abs_diff": diffs,
             "argmax_agrees_everywhere": all(agree), "argmax_positions_agree": n_pos_agree,
             "argmax_positions": check_b * k, "max_abs_logit": logit_scale}
    log(f"check B={check_b}: max |batched - alone| = {max(diffs):.4g} (max |logit| {logit_scale:.3g}); "
        f"argmax agrees on {n_pos_agree}/{check_b * k} positions")

    # one-by-one: B single-row forwards, one after another
    seq = {}
    for B in seq_bs:
        def one_by_one(B=B):
            for h in hs[:B]:
                step([h])
        ms, ts = timed(one_by_one, 1, seq_runs)
        seq[B] = {"ms_per_step": ms, "batched_ms": per_b[B]["ms_per_forward"],
                  "batched_speedup": ms / per_b[B]["ms_per_forward"], "runs_ms": [round(x, 3) for x in ts]}
        log(f"one-by-one B={B}: {ms:.2f} ms vs batched {per_b[B]['ms_per_forward']:.2f} ms "
            f"-> batched speedup x{seq[B]['batched_speedup']:.2f}")

    result = {
        "commit": _commit(),
        "device": dev_name,
        "torch": torch.__version__,
        "transformers": tf_version,
        "dtype": str(dtype),
        "attn_implementation": cfg._attn_implementation,
        "model": {"params": n_params, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                  "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads, "vocab": V},
        "sessions": n_sessions, "context": ctx, "tokens_per_row": k, "keep": k,
        "pool": {"blocks_total": pool.blocks_total, "block_size": pool.block_size,
                 "tokens_capacity": pool.tokens_capacity},
        "prefill_s": prefill_s,
        "warmup": warmup, "timed_runs": runs,
        "per_batch": {str(b): v for b, v in per_b.items()},
        "one_by_one": {str(b): v for b, v in seq.items()},
        "correctness": check,
    }
    if device.type == "cuda":
        result["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    path = os.path.join(args.out, "gpu_verify_batch.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    log(f"wrote {path}")


def _commit() -> str:
    """The commit measured (benchmarks/results' files are stamped with it), "" outside a git checkout."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


if __name__ == "__main__":
    main()
