"""Benchmark: a pool of drafter kinds against each of its drafters alone and against the target alone.

One stack, side by side on the same machine and prompts, through REST, greedy, one client: a verifier
(``--target``), one drafter service per kind (``--drafters``, in the pool's order: the cheapest first),
a gateway per kind alone (``--drafter <kind>``) and a gateway with the pool (``--drafter <first>
--drafter-pool NAME=...`` for the others); target-only is ``use_drafter=false``. Each request is a
one-off (no session): the pool chooses from the prompt's spelling, what the gateway's earlier requests of
the prompt's class measured (its priors), and the request's own rounds, with no earlier turn to learn from.
Prompt classes: English code, English prose, Chinese.
Each prompt runs in every mode back to back, the modes' order rotating by prompt and repeat, so a slow drift of
the machine hits all modes alike.

Per class and over the mixed workload: tokens/s of each mode (completion tokens over the requests'
summed latency), the pool's ratio to the best single choice of the same run (either drafter, or none)
and to the best single drafter, which kind the pool's requests ended on, and whether every greedy text
matched target-only's.

Each target in ``--targets`` gets a stack of its own, one after the other, with the same pool.
Writes benchmarks/results/<tag>-<machine class>.json and .png (stamped with commit and CPU).
Usage: python benchmarks/bench_pool.py [--targets qwen2.5-coder-1.5b,gemma3-270m]
       [--drafters smollm2-135m,qwen2.5-coder-0.5b] [--dtype bfloat16] [--repeats 3] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import requests  # noqa: E402
from bench import MIXED_PROMPTS, _cpu_name, git_commit, humaneval_prompts  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from gateway.pool import kind_name  # noqa: E402
from tests.service_fixtures import Services  # noqa: E402

CLASSES = ("code", "prose", "chinese")


def prompts(per_class: int) -> list[tuple[str, str]]:
    """(class, prompt): the mixed set's code, prose and Chinese prompts, code topped up from HumanEval."""
    out = [(c, p) for c, p in MIXED_PROMPTS if c in CLASSES]
    out += [("code", p) for p in humaneval_prompts(8)[2:2 + per_class]]
    by = {c: [p for k, p in out if k == c][:per_class] for c in CLASSES}
    return [(c, p) for c in CLASSES for p in by[c]]


def start(s: Services, a, target: str) -> dict:
    """The model servers and gateways; mode -> (REST URL, use_drafter)."""
    extra = ["--dtype", a.dtype, "--kv-cache-tokens", str(a.kv_cache_tokens)]
    _, vaddr = s.verifier(target, extra=extra)
    names, addrs = [], []
    for model in a.drafters.split(","):
        _, addr = s.drafter(model, extra=extra, quantize=a.drafter_quantize)
        names.append(kind_name(model))
        addrs.append(addr)
    s.ready(timeout=900)
    modes = {}
    for name, addr in zip(names, addrs, strict=True):
        _, modes[name], _ = s.gateway(vaddr, addr, drafter_timeout_s=120)
    pool = [x for n, addr in zip(names[1:], addrs[1:], strict=True) for x in ("--drafter-pool", f"{n}={addr}")]
    _, modes["pool"], _ = s.gateway(vaddr, addrs[0], drafter_timeout_s=120, extra=pool)
    s.ready(timeout=900)
    out = {"target-only": (modes["pool"], False)}
    out.update({m: (url, True) for m, url in modes.items()})
    return out


def one(url: str, prompt: str, a, use_drafter: bool) -> dict:
    body = {"prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": 0, "use_drafter": use_drafter}
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=3600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    d = r.json()
    st = d.get("speculative", {})
    return {"latency_s": dt, "tokens": d["usage"]["completion_tokens"], "text": d["choices"][0]["text"],
            "drafter": st.get("drafter", ""), "switches": st.get("drafter_switches", 0),
            "choice": st.get("drafter_choice", ""), "drafted": st.get("drafted", 0), "accepted": st.get("accepted", 0),
            "skipped_rounds": st.get("skipped_rounds", 0), "rounds": st.get("rounds", 0)}


def summarize(rows: list[dict], kinds: list[str]) -> dict:
    """Tokens/s per (class, mode) and over all classes; the pool against the best single choice."""
    out: dict = {}
    for cls in (*CLASSES, "mixed"):
        sel = [r for r in rows if cls == "mixed" or r["class"] == cls]
        if not sel:
            continue
        tps = {}
        for mode in ("target-only", *kinds, "pool"):
            rs = [r for r in sel if r["mode"] == mode]
            tps[mode] = round(sum(r["tokens"] for r in rs) / sum(r["latency_s"] for r in rs), 3) if rs else 0.0
        singles = {m: v for m, v in tps.items() if m != "pool"}
        best = max(singles, key=singles.get)
        best_drafter = max(kinds, key=lambda m: tps[m])
        pool_rows = [r for r in sel if r["mode"] == "pool"]
        ended = {}
        for r in pool_rows:
            key = r["drafter"] if r["drafted"] or r["choice"] != "none" else "none"
            ended[key] = ended.get(key, 0) + 1
        choices = {}  # the requests' last choice: start / prior (stayed where they began), explore, exploit, none
        for r in pool_rows:
            choices[r["choice"]] = choices.get(r["choice"], 0) + 1
        out[cls] = {"tok_s": tps, "best_single": best, "pool_vs_best_single": round(tps["pool"] / tps[best], 3),
                    "best_drafter": best_drafter,
                    "pool_vs_best_drafter": round(tps["pool"] / tps[best_drafter], 3),
                    "pool_vs_target_only": round(tps["pool"] / tps["target-only"], 3), "pool_ended_on": ended,
                    "pool_choices": choices,
                    "pool_switches": sum(r["switches"] for r in pool_rows), "requests": len(pool_rows)}
    return out


def identity(rows: list[dict]) -> dict:
    """Whether each speculative greedy text matched target-only's for the same prompt and repeat."""
    ref = {(r["prompt"], r["repeat"]): r["text"] for r in rows if r["mode"] == "target-only"}
    spec = [r for r in rows if r["mode"] != "target-only"]
    same = sum(1 for r in spec if ref.get((r["prompt"], r["repeat"])) == r["text"])
    return {"identical": same, "requests": len(spec)}


def plot(res: dict, path: Path, kinds: list[str]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    targets = list(res["by_target"])
    modes = ["target-only", *kinds, "pool"]
    fig, axes = plt.subplots(1, len(targets), figsize=(7 * len(targets), 4.5), squeeze=False)
    m = res["meta"]
    for ax, target in zip(axes[0], targets, strict=True):
        summary = res["by_target"][target]["summary"]
        classes = list(summary)
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            ax.bar([x + (i - (len(modes) - 1) / 2) * width for x in range(len(classes))],
                   [summary[c]["tok_s"][mode] for c in classes], width, label=mode)
        ax.set_xticks(range(len(classes)))
        ax.set_xticklabels([f"{c}\npool {summary[c]['pool_vs_best_single']:.2f}x best" for c in classes],
                           fontsize=8)
        ax.set_ylabel("completion tokens/s (1 client, greedy)")
        ax.set_title(f"pool of {', '.join(kinds)} -> {target} ({m['dtype']})\n{m['cpu']} @ {m['commit'][:7]}",
                     fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def run_target(a, target: str, ps: list[tuple[str, str]], kinds: list[str]) -> dict:
    """One target's stack and its rows, summary and greedy identity."""
    tmp = Path(tempfile.mkdtemp(prefix="crossdraft-pool-"))
    (tmp / "logs").mkdir()
    rows = []
    with Services(tmp / "logs") as s:
        urls = start(s, a, target)
        modes = list(urls)
        for url, use in urls.values():  # warm each gateway's paths (first tokenizations, masks sent)
            one(url, ps[0][1], argparse.Namespace(max_new_tokens=4), use)
        for rep in range(a.repeats):
            # each prompt runs in every mode back to back (the modes' order rotating by prompt and repeat):
            # the machine's speed drifts by 10-20% over minutes here, and a mode's requests run as one block
            # would take that drift for a difference between the modes
            for i, (cls, prompt) in enumerate(ps):
                k = (rep + i) % len(modes)
                for mode in modes[k:] + modes[:k]:
                    url, use = urls[mode]
                    r = one(url, prompt, a, use)
                    rows.append({"mode": mode, "class": cls, "prompt": prompt, "repeat": rep, **r})
            for mode in modes:
                got = [x for x in rows if x["repeat"] == rep and x["mode"] == mode]
                print(f"{target} repeat {rep} {mode:22s} " + "  ".join(
                    f"{x['class']}:{x['tokens'] / x['latency_s']:.2f}" + (f"[{x['drafter']}]" if mode == "pool" else "")
                    for x in got), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    res = {"summary": summarize(rows, kinds), "greedy_identity": identity(rows), "rows": rows}
    for cls, v in res["summary"].items():
        print(target, cls, json.dumps(v), flush=True)
    print(target, "greedy identity:", json.dumps(res["greedy_identity"]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default="qwen2.5-coder-1.5b,gemma3-270m")
    ap.add_argument("--drafters", default="smollm2-135m,qwen2.5-coder-0.5b", help="the pool's kinds, in order")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter-quantize", default="auto", choices=("auto", "int4", "int8", "none"),
                    help="the drafter servers' --quantize (auto: their default, int8 copies where they measure faster)")
    ap.add_argument("--per-class", type=int, default=2, help="prompts per class")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-cache-tokens", type=int, default=8192, help="each model server's KV pool")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    ps = prompts(a.per_class)
    kinds = [kind_name(m) for m in a.drafters.split(",")]
    targets = [t for t in a.targets.split(",") if t]
    res = {"meta": {"targets": targets, "drafters": kinds, "dtype": a.dtype,
                    "drafter_quantize": a.drafter_quantize, "cpu": _cpu_name(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine(),
                    "max_new_tokens": a.max_new_tokens, "prompts": len(ps), "repeats": a.repeats, **git_commit(),
                    "time": time.strftime("%Y-%m-%d %H:%M")},
           "by_target": {t: run_target(a, t, ps, kinds) for t in targets}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result_name(a.tag or "pool")
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (tag + '.json')}", flush=True)
    if plot(res, out / f"{tag}.png", kinds):
        print(f"wrote {out / (tag + '.png')}", flush=True)


if __name__ == "__main__":
    main()
