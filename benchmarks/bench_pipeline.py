"""Benchmark: pipelined rounds vs serial rounds, each model on its own cores, through REST.

One run, side by side on the same machine and prompts (HumanEval), greedy and sampled:

* ``target-only``  -- the pinned stack's target alone (``use_drafter=false``): the verifier's cores only;
* ``serial``       -- the pinned stack (drafter on ``--drafter-cpus``, verifier on ``--verifier-cpus``),
  its gateway with ``--pipeline off``: draft, then verify;
* ``pipelined``    -- the same model servers, a second gateway with ``--pipeline on``: the next block is
  drafted while this one is verified;
* ``branch``       -- the same model servers, a third gateway with ``--pipeline on --branch on``: beside
  each block ahead, the block after the likeliest correction (greedy rounds of one vocabulary);
* ``default``      -- today's default a user has: both model servers unpinned (all cores each), the
  gateway's ``--pipeline auto`` (two servers on the loopback are colocated: serial);
* ``pipelined-unpinned`` -- the unpinned model servers with ``--pipeline on`` (both models' threads
  then compete for all the cores: what ``auto`` avoids).

For each of 1 and 16 clients (``--clients``) and each temperature: tokens/s, acceptance, overhead per
round (the gateway's ``overhead_ms`` / rounds), blocks pipelined and dropped, branches drafted and
used; greedy texts are compared
between modes (the same prompt gives the same text in every mode). The modes run in rotating order
per repeat, so a slow drift of the machine hits all alike.

Writes benchmarks/results/<tag>-<machine class>.json and .png (stamped with commit and CPU).
Usage: python benchmarks/bench_pipeline.py [--target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b]
       [--dtype bfloat16] [--drafter-cpus 0 --verifier-cpus 1] [--clients 1,16] [--temperatures 0,0.7]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
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
from bench_concurrency import point  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from tests.service_fixtures import Services  # noqa: E402

MODES = ("target-only", "serial", "pipelined", "branch", "default", "pipelined-unpinned")


def start(s: Services, a) -> dict:
    """Both stacks on one Redis: pinned model servers with their gateways, unpinned ones with two -- each
    stack only where a mode asks for it (four fp32 model servers of the default pair fill 24 GB). The KV
    pools are sized for the benchmark."""
    modes = a.modes.split(",")
    unpinned = "default" in modes or "pipelined-unpinned" in modes
    pinned = not unpinned or any(m in modes for m in ("target-only", "serial", "pipelined", "branch"))
    dtype = ["--dtype", a.dtype, "--kv-cache-tokens", str(a.kv_cache_tokens)]
    threads = {"OMP_NUM_THREADS": str(os.cpu_count() or 2)}  # unpinned: every core, as a user runs it
    if pinned:
        _, v_pin = s.verifier(a.target, extra=[*dtype, "--cpus", a.verifier_cpus])
        _, d_pin = s.drafter(a.drafter, extra=[*dtype, "--cpus", a.drafter_cpus], quantize=a.drafter_quantize)
    if unpinned:
        _, v_all = s.verifier(a.target, extra=dtype, env=threads)
        _, d_all = s.drafter(a.drafter, extra=dtype, env=threads, quantize=a.drafter_quantize)
    s.ready()
    urls = {}
    if pinned:
        _, urls["serial"], _ = s.gateway(v_pin, d_pin, extra=["--pipeline", "off"], drafter_timeout_s=120)
        _, urls["pipelined"], _ = s.gateway(v_pin, d_pin, extra=["--pipeline", "on"], drafter_timeout_s=120)
        urls["target-only"] = urls["serial"]
    if "branch" in modes:
        _, urls["branch"], _ = s.gateway(v_pin, d_pin, extra=["--pipeline", "on", "--branch", "on"],
                                         drafter_timeout_s=120)
    if unpinned:
        _, urls["default"], _ = s.gateway(v_all, d_all, drafter_timeout_s=120)
        _, urls["pipelined-unpinned"], _ = s.gateway(v_all, d_all, extra=["--pipeline", "on"], drafter_timeout_s=120)
    s.ready()
    return urls


def stats_of(url: str, prompt: str, a, temperature: float, use_drafter: bool) -> dict:
    """One request's speculative stats (rounds, overhead, blocks pipelined and dropped)."""
    body = {"prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": temperature, "seed": 7,
            "use_drafter": use_drafter}
    r = requests.post(url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    return r.json().get("speculative", {})


def run_point(urls: dict, mode: str, ps: list[str], a, clients: int, temperature: float) -> dict:
    use = mode != "target-only"
    p = point(urls[mode], ps, a, clients, temperature, "spec" if use else "target")
    # the rounds' own numbers, from one more request per prompt at one client (not timed)
    st = [stats_of(urls[mode], q, a, temperature, use) for q in ps[: a.stats_prompts]]
    rounds = sum(x.get("rounds", 0) for x in st)
    p.update(mode=mode, temperature=temperature,
             overhead_ms_per_round=sum(x.get("overhead_ms", 0.0) for x in st) / rounds if rounds else 0.0,
             pipelined_blocks=sum(x.get("pipelined_blocks", 0) for x in st),
             dropped_blocks=sum(x.get("dropped_blocks", 0) for x in st), stats_rounds=rounds,
             branches=sum(x.get("branches", 0) for x in st), branch_blocks=sum(x.get("branch_blocks", 0) for x in st))
    return p


def summarize(points: list[dict]) -> dict:
    """Median tokens/s per (mode, clients, temperature) over the repeats, and the ratios the issue asks for."""
    out: dict = {}
    for p in points:
        out.setdefault((p["temperature"], p["clients"]), {}).setdefault(p["mode"], []).append(p["tokens_per_s"])
    rows = []
    for (temp, clients), by_mode in sorted(out.items()):
        med = {m: statistics.median(v) for m, v in by_mode.items()}
        row = {"temperature": temp, "clients": clients, **{f"{m}_tok_s": round(v, 3) for m, v in med.items()}}
        if med.get("serial"):
            row["pipelined_vs_serial"] = round(med.get("pipelined", 0.0) / med["serial"], 3)
        if med.get("branch") and med.get("pipelined"):
            row["branch_vs_pipelined"] = round(med["branch"] / med["pipelined"], 3)
        if med.get("default"):
            row["pipelined_vs_default"] = round(med.get("pipelined", 0.0) / med["default"], 3)
            row["serial_vs_default"] = round(med.get("serial", 0.0) / med["default"], 3)
        if med.get("target-only"):
            row["pipelined_vs_target_only"] = round(med.get("pipelined", 0.0) / med["target-only"], 3)
        rows.append(row)
    return {"rows": rows}


def greedy_identity(points: list[dict]) -> dict:
    """Per greedy point group: whether every mode gave the same text for each request index."""
    groups: dict = {}
    for p in points:
        if p["temperature"] == 0:
            groups.setdefault(p["clients"], []).append(p)
    out = {}
    for clients, ps in groups.items():
        texts = [p["texts"] for p in ps]
        keys = set().union(*texts)
        same = sum(1 for k in keys if len({t.get(k) for t in texts}) == 1)
        out[str(clients)] = {"identical": same, "requests": len(keys)}
    return out


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = res["summary"]["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{r['clients']} client(s)\nT={r['temperature']:g}" for r in rows]
    shown = [m for m in MODES if any(f"{m}_tok_s" in r for r in rows)]
    width = 0.8 / len(shown)
    for i, mode in enumerate(shown):
        ax.bar([x + (i - (len(shown) - 1) / 2) * width for x in range(len(rows))],
               [r.get(f"{mode}_tok_s", 0) for r in rows], width, label=mode)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("aggregate completion tokens/s")
    m = res["meta"]
    ax.set_title(f"{m['drafter']} -> {m['target']} ({m['dtype']}), drafter cpus {m['drafter_cpus']}, verifier "
                 f"cpus {m['verifier_cpus']}\n{m['cpu']} @ {m['commit'][:7]}", fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--drafter-quantize", default="auto", choices=("auto", "int4", "int8", "none"),
                    help="the drafter server's --quantize (auto: its default, int8 copies where they measure faster)")
    ap.add_argument("--drafter-cpus", default="0")
    ap.add_argument("--verifier-cpus", default="1")
    ap.add_argument("--clients", default="1,16")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--stats-prompts", type=int, default=2, help="untimed requests per point read for round stats")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--kv-cache-tokens", type=int, default=16384, help="each model server's KV pool")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    a.unseeded = False
    ps = humaneval_prompts(a.prompts)
    tmp = Path(tempfile.mkdtemp(prefix="crossdraft-pipe-"))
    (tmp / "logs").mkdir()
    modes = [m for m in a.modes.split(",") if m]
    points = []
    with Services(tmp / "logs") as s:  # (stops every process started, also when one fails to start)
        urls = start(s, a)
        for c in (int(x) for x in a.clients.split(",")):
            for temp in (float(x) for x in a.temperatures.split(",")):
                for rep in range(a.repeats):
                    order = modes[rep % len(modes):] + modes[: rep % len(modes)]
                    for mode in order:
                        p = run_point(urls, mode, ps, a, c, temp)
                        points.append(p)
                        print(f"clients={c} T={temp:g} {mode:12s} {p['tokens_per_s']:7.2f} tok/s  acc "
                              f"{p['acceptance']:.2f}  overhead {p['overhead_ms_per_round']:.2f} ms/round  "
                              f"pipelined {p['pipelined_blocks']} dropped {p['dropped_blocks']}  "
                              f"branches {p['branch_blocks']}/{p['branches']}  "
                              f"failed {p['failed']}", flush=True)
    res = {"meta": {"target": a.target, "drafter": a.drafter, "dtype": a.dtype, "cpu": _cpu_name(),
                    "cpus": os.cpu_count(), "python": platform.python_version(), "drafter_cpus": a.drafter_cpus,
                    "verifier_cpus": a.verifier_cpus,
                    "drafter_quantize": a.drafter_quantize, "max_new_tokens": a.max_new_tokens, "prompts": len(ps),
                    "repeats": a.repeats, **git_commit(), "time": time.strftime("%Y-%m-%d %H:%M")},
           "summary": summarize(points), "greedy_identity": greedy_identity(points), "points": points}
    for r in res["summary"]["rows"]:
        print(json.dumps(r), flush=True)
    print("greedy identity:", json.dumps(res["greedy_identity"]), flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result_name(a.tag or f"pipeline-{a.drafter}-{a.target}")
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (tag + '.json')}", flush=True)
    if plot(res, out / f"{tag}.png"):
        print(f"wrote {out / (tag + '.png')}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
