"""Benchmark: fp32 CPU linear layers, torch's default (plain) vs oneDNN-packed weights, side by side.

Loads the pair twice -- ``plain``: ``cpu_linear="plain"`` and a float drafter (the defaults before
crossdraft.models.cpulinear); ``packed``: ``cpu_linear="packed"`` and the drafter with ``--drafter-quantize``
(default ``auto``: int8 copies with bf16 activations where they measure faster, crossdraft.models.quant)
-- and, per prompt
and repeat, runs in alternating order target-only and speculative greedy decoding with each, so a
slow moment of the shared machine hits both alike. Prints tokens/s, the packed/plain ratios and
whether every greedy output equals the plain target-only one; writes ``<out>/<tag>.json`` with the
commit measured.

    python benchmarks/bench_cpu_linear.py [--target qwen2.5-coder-1.5b] [--drafter qwen2.5-coder-0.5b]
        [--prompts 2] [--max-new-tokens 48] [--repeats 2] [--tag cpu-linear]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--prompt-set", default="smoke", help="a prompt set of bench.py (smoke, humaneval, mixed, a+b)")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--tag", default="cpu-linear")
    ap.add_argument("--drafter-quantize", default="auto", choices=("auto", "none", "int8", "int4"))
    a = ap.parse_args()

    import bench
    import torch

    from crossdraft.engine import Engine
    from crossdraft.models import loading as M

    prompts = bench.prompt_set(a.prompt_set, a.prompts)
    engines, loaded = {}, {}
    for mode in ("plain", "packed"):
        t0 = time.perf_counter()
        target = M.load_model(a.target, dtype="float32", cpu_linear=mode, progress=False)
        q = a.drafter_quantize if mode == "packed" else "none"
        drafter = M.load_model(a.drafter, dtype="float32", cpu_linear=mode, quantize=q,
                               progress=False) if a.drafter else None
        engines[mode] = Engine(target, drafter)
        loaded[mode] = {"target": target.cpu_linear, "drafter": drafter.cpu_linear if drafter else "",
                        "drafter_quantize": f"{drafter.quantize} {drafter.quantize_act}".strip() if drafter else ""}
        print(f"{mode}: loaded in {time.perf_counter() - t0:.1f}s {loaded[mode]}", flush=True)
        if mode == "packed" and target.cpu_linear != "packed":
            print("oneDNN packing not available here: nothing to compare", flush=True)
            return 1
    methods = [(m, spec) for spec in (False, True) for m in ("plain", "packed")] if a.drafter else \
        [(m, False) for m in ("plain", "packed")]
    runs = []
    for pi, (label, prompt) in enumerate(prompts):
        ref = None
        for r in range(a.repeats):
            order = methods if r % 2 == 0 else methods[::-1]
            for mode, spec in order:
                out = engines[mode].generate(prompt, max_new_tokens=a.max_new_tokens, use_drafter=spec)
                ref = ref if ref is not None else (out.token_ids if (mode, spec) == ("plain", False) else None)
                row = {"prompt": pi, "label": label, "repeat": r, "cpu_linear": mode,
                       "method": "speculative" if spec else "target-only", "tokens": len(out.token_ids),
                       "seconds": out.stats.total_s, "drafted": out.stats.drafted, "accepted": out.stats.accepted,
                       "token_ids": out.token_ids}
                runs.append(row)
                print(f"  p{pi} r{r} {row['method']:12s} {mode:7s} {row['tokens']} tok {row['seconds']:6.2f}s "
                      f"{row['tokens'] / row['seconds']:6.2f} tok/s drafted {row['drafted']} "
                      f"accepted {row['accepted']}", flush=True)
    # greedy identity: every run equals the plain target-only run of its prompt
    base = {r["prompt"]: r["token_ids"] for r in runs if (r["cpu_linear"], r["method"]) == ("plain", "target-only")}
    identical = sum(r["token_ids"] == base[r["prompt"]] for r in runs)
    summary = {}
    for mode, spec in methods:
        method = "speculative" if spec else "target-only"
        rs = [r for r in runs if r["cpu_linear"] == mode and r["method"] == method]
        summary[f"{method}/{mode}"] = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
    print("\n| method | plain tok/s | packed tok/s | packed / plain |\n|---|---:|---:|---:|")
    for method in ("target-only", "speculative") if a.drafter else ("target-only",):
        p, q = summary[f"{method}/plain"], summary[f"{method}/packed"]
        print(f"| {method} | {p:.2f} | {q:.2f} | {q / p:.2f}x |")
    if a.drafter:
        for mode in ("plain", "packed"):
            print(f"speculative / target-only with {mode}: "
                  f"{summary[f'speculative/{mode}'] / summary[f'target-only/{mode}']:.2f}x")
        best = summary["speculative/packed"] / summary["target-only/plain"]
        print(f"packed speculative / plain target-only: {best:.2f}x")
    print(f"greedy outputs equal to plain target-only: {identical}/{len(runs)}")
    # per-run ratios of neighbours are noisy; the medians by prompt are kept in the JSON too
    by_prompt = {}
    for pi in range(len(prompts)):
        t = [r["seconds"] / r["tokens"] for r in runs if r["prompt"] == pi and r["method"] == "target-only"
             and r["cpu_linear"] == "plain"]
        u = [r["seconds"] / r["tokens"] for r in runs if r["prompt"] == pi and r["method"] == "target-only"
             and r["cpu_linear"] == "packed"]
        by_prompt[pi] = statistics.median(t) / statistics.median(u)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"target": a.target, "drafter": a.drafter, "dtype": "float32", "prompts": [lbl for lbl, _ in prompts],
            "max_new_tokens": a.max_new_tokens, "repeats": a.repeats, **bench.git_commit(),
            "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
            "cpu": bench._cpu_name(),
            "time": time.strftime("%Y-%m-%d %H:%M"), "loaded": loaded}
    for r in runs:
        del r["token_ids"]
    (out / f"{a.tag}.json").write_text(json.dumps({"meta": meta, "summary": summary, "identical": identical,
                                                   "target_only_packed_speedup_by_prompt": by_prompt,
                                                   "runs": runs}, indent=1))
    print(f"wrote {out / (a.tag + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
