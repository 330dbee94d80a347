"""Benchmark: aggregate throughput through the REST gateway with many concurrent clients.

The whole stack runs as separate processes on 127.0.0.1 (Redis, drafter, verifier, gateway), once
per code version: this checkout (batched model servers) and, with ``--baseline REV``, the code of
an earlier commit checked out into a git worktree (e.g. the last commit before batching), in the
same run, on the same machine, with the same prompts. For each version, mode (speculative /
target-only), temperature and number of clients, N client threads send requests (16+ distinct code
and prose prompts, round robin; ``--prompt-class chinese --prompts 1`` sends only the mixed set's first
Chinese prompt, text an English drafter cannot spell) and the run reports completion tokens per second
over the wall time of the point, and the p50 / p95 request latency.

Greedy fidelity: every greedy request's text is compared with the same prompt's text from the
1-client point of the same version and mode (a batch of one): batching must not change a token.

Writes ``<out>/<tag>.json`` (with the measured commit) and, if matplotlib is importable,
``<out>/<tag>.png``.

Usage: python benchmarks/bench_concurrency.py [--target gemma3-270m] [--drafter smollm2-135m]
       [--clients 1,2,4,8,16,32] [--temperatures 0,0.7] [--modes spec,target] [--max-new-tokens 64]
       [--prompt-class chinese] [--dtype float32] [--target-dtype T] [--drafter-dtype D]
       [--baseline 44fe2e0] [--tag NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import requests  # noqa: E402
from bench import MIXED_PROMPTS, _cpu_name, git_commit, humaneval_prompts  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from crossdraft.serving.redis_server import RedisServer  # noqa: E402
from tests.service_fixtures import free_port  # noqa: E402


def prompts(n: int, cls: str = "") -> list[str]:
    """n distinct prompts: the mixed set (code, prose, SQL, Chinese) then HumanEval; with ``cls`` only the
    mixed set's prompts of that class (e.g. ``chinese``: text an English drafter cannot spell), at most n."""
    if cls:
        out = [p for c, p in MIXED_PROMPTS if c == cls]
        if not out:
            raise SystemExit(f"--prompt-class: no prompt of class {cls!r} "
                             f"(classes: {', '.join(sorted({c for c, _ in MIXED_PROMPTS}))})")
        return out[:n]
    out = [p for _, p in MIXED_PROMPTS]
    if n > len(out):
        out += humaneval_prompts(n - len(out))
    return out[:n]


class Service:
    """One service process of a given code checkout (its own cwd, so its own code)."""

    def __init__(self, code: Path, name: str, args: list[str], log_dir: Path, threads: int):
        self.name = name
        self.log = open(log_dir / f"{name}.log", "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), PYTHONPATH=str(code))
        self.p = subprocess.Popen([sys.executable, "-m", *args], cwd=code, stdout=self.log, stderr=subprocess.STDOUT,
                                  env=env)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()


class Stack:
    def __init__(self, code: Path, a, log_dir: Path, extra_model_args: list[str]):
        self.procs: list[Service] = []
        self.redis = RedisServer().start()
        dp, vp, hp, gp = free_port(), free_port(), free_port(), free_port()
        # the model servers' /metrics: how many sessions each batched forward served
        self.metrics = {"verifier": free_port()} | ({"drafter": free_port()} if a.drafter else {})
        common = ["--host", "127.0.0.1", "--max-sessions", "128"] + extra_model_args
        if a.drafter:
            self.procs.append(Service(code, "drafter", ["drafter", "--model", a.drafter, "--port", str(dp),
                                                        "--metrics-port", str(self.metrics["drafter"]),
                                                        "--dtype", a.drafter_dtype or a.dtype] + common,
                                      log_dir, a.threads))
        self.procs.append(Service(code, "verifier", ["verifier", "--model", a.target, "--port", str(vp),
                                                     "--metrics-port", str(self.metrics["verifier"]),
                                                     "--dtype", a.target_dtype or a.dtype] + common,
                                  log_dir, a.threads))
        gw = ["gateway", "--verifier", f"127.0.0.1:{vp}", "--redis-url", self.redis.url, "--host", "127.0.0.1",
              "--http-port", str(hp), "--grpc-port", str(gp),
              "--drafter-timeout-s", "120", "--connect-timeout-s", "900"]
        if a.drafter:
            gw += ["--drafter", f"127.0.0.1:{dp}"]
        self.procs.append(Service(code, "gateway", gw, log_dir, 1))
        self.url = f"http://127.0.0.1:{hp}"
        t0 = time.time()
        while time.time() - t0 < 1200:
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            if any(p.p.poll() is not None for p in self.procs):
                dead = [f"{p.name} (exit {p.p.returncode})" for p in self.procs if p.p.poll() is not None]
                self.stop()
                raise RuntimeError(f"{', '.join(dead)} exited; see {log_dir}")
            time.sleep(1)
        raise RuntimeError("the stack did not get ready")

    def pids(self) -> dict[str, int]:
        out = {p.name: p.p.pid for p in self.procs}
        if getattr(self.redis, "_proc", None) is not None:  # the benchmark's own server: its pid is ours to read
            out["redis"] = self.redis._proc.pid
        return out

    def stop(self):
        for p in reversed(self.procs):
            p.stop()
        self.redis.stop()


def batch_rows(ports: dict[str, int]) -> dict[str, tuple[float, float]]:
    """Each model server's batched forwards so far: {name: (rows, forwards)} from its /metrics
    (crossdraft_<kind>_batch_rows); a server that does not answer is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for name, port in ports.items():
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        except requests.RequestException:
            continue
        for fam in text_string_to_metric_families(text):
            if fam.name == f"crossdraft_{name}_batch_rows":
                got = {smp.name.rsplit("_", 1)[1]: smp.value for smp in fam.samples}
                out[name] = (got.get("sum", 0.0), got.get("count", 0.0))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc (Linux; 0.0 elsewhere)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def cpu_now(procs: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in procs.items()}


def mode_body(mode: str) -> dict:
    """The request fields of a mode: ``spec`` (the gateway's chooser), ``target`` (no drafter), ``fixedK``
    (blocks of exactly K drafts every round, ``adaptive_draft`` off: what a fixed-length engine does)."""
    if mode.startswith("fixed"):
        return {"use_drafter": True, "num_draft_tokens": int(mode[5:]), "adaptive_draft": False}
    return {"use_drafter": mode == "spec"}


def one_request(url: str, prompt: str, a, temperature: float, mode: str, seed: int) -> dict:
    body = {"prompt": prompt, "max_tokens": a.max_new_tokens, "temperature": temperature, "seed": seed,
            **mode_body(mode)}
    if a.unseeded and temperature > 0:  # no seed: the gateway prices drafting like greedy (gateway.job.draft_config)
        del body["seed"]
    t0 = time.perf_counter()
    r = requests.post(url + "/v1/completions", json=body, timeout=3600)
    dt = time.perf_counter() - t0
    if r.status_code != 200:
        return {"ok": False, "status": r.status_code, "latency_s": dt, "error": r.text[:300]}
    d = r.json()
    st = d.get("speculative", {})
    return {"ok": True, "latency_s": dt, "text": d["choices"][0]["text"], "tokens": d["usage"]["completion_tokens"],
            "rounds": st.get("rounds", 0), "drafted": st.get("drafted", 0), "accepted": st.get("accepted", 0)}


def point(url: str, ps: list[str], a, clients: int, temperature: float, mode: str,
          procs: dict[str, int] | None = None, metrics: dict[str, int] | None = None) -> dict:
    """`clients` threads; request i (prompt i % len(ps)) goes to thread i % clients; all start together.

    With ``procs`` (name -> pid), also the CPU seconds each process spent during the point, per
    completion token (where the time of a mode goes when the machine is the bottleneck); with
    ``metrics`` (server name -> its /metrics port), the sessions each batched forward served."""
    n_req = max(a.min_requests, clients * a.requests_per_client)
    jobs: list[list[int]] = [[] for _ in range(clients)]
    for i in range(n_req):
        jobs[i % clients].append(i)
    results: dict[int, dict] = {}
    barrier = threading.Barrier(clients + 1)

    def client(c):
        barrier.wait()
        for i in jobs[c]:
            results[i] = one_request(url, ps[i % len(ps)], a, temperature, mode, seed=i)

    ts = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in ts:
        t.start()
    procs = dict(procs or {}, client=os.getpid())
    rows0 = batch_rows(metrics or {})
    barrier.wait()
    cpu0 = cpu_now(procs)
    t0, started = time.perf_counter(), time.time()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    cpu1 = cpu_now(procs)
    rows1 = batch_rows(metrics or {})
    rows_per_forward = {k: round((rows1[k][0] - rows0[k][0]) / (rows1[k][1] - rows0[k][1]), 2)
                        for k in rows1 if k in rows0 and rows1[k][1] > rows0[k][1]}
    ok = [results[i] for i in range(n_req) if results[i]["ok"]]
    lat = sorted(r["latency_s"] for r in ok)
    tokens = sum(r["tokens"] for r in ok)
    drafted = sum(r["drafted"] for r in ok)

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

    # (when, in epoch seconds: samples taken beside a run -- a server's /proc, a round log -- split by point)
    return {"clients": clients, "requests": n_req, "failed": n_req - len(ok), "wall_s": wall, "tokens": tokens,
            "started_at": round(started, 3), "ended_at": round(started + wall, 3),
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "p50_latency_s": pct(0.5), "p95_latency_s": pct(0.95),
            "mean_latency_s": statistics.mean(lat) if lat else 0.0,
            "acceptance": sum(r["accepted"] for r in ok) / drafted if drafted else 0.0,
            "cpu_ms_per_token": {k: round(1000 * (cpu1[k] - cpu0[k]) / max(1, tokens), 3) for k in procs},
            "rows_per_forward": rows_per_forward,
            "texts": {i: results[i].get("text") for i in range(n_req)}}


def gate_state(url: str) -> dict:
    """The gateway's load gates now (its /metrics): {load: {held, free, held_goodput, switches}} over its
    verifiers (crossdraft.decoding.gate; {} from a gateway without them)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return {}
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("crossdraft_load_gate"):
            continue
        for s in fam.samples:
            at = out.setdefault(s.labels["load"], {})
            if s.name == "crossdraft_load_gate_held":
                at["held"] = bool(s.value)
            elif s.name == "crossdraft_load_gate_goodput":
                at["free" if s.labels["regime"] == "free" else "held_goodput"] = round(s.value, 3)
            elif s.name == "crossdraft_load_gate_switches_total":
                at["switches"] = int(s.value)
    return out


def run_version(label: str, code: Path, a, ps: list[str], log_dir: Path, extra: list[str], clients_list: str = "",
                modes_list: str = "") -> dict:
    print(f"[{label}] starting the stack from {code}", flush=True)
    logs = log_dir / "".join(c if c.isalnum() else "-" for c in label)
    logs.mkdir(parents=True, exist_ok=True)
    stack = Stack(code, a, logs, extra)
    out = {"label": label, "code": str(code), "points": []}
    try:
        one_request(stack.url, "def warm_up(x):\n", a, 0.0, "spec", 0)  # load, time the costs, JIT paths
        modes = [m for m in (modes_list or a.modes).split(",") if m and (m != "spec" or a.drafter)]
        alone: dict[tuple, dict] = {}  # (mode, temperature) -> texts at the first client count
        for temperature in [float(x) for x in a.temperatures.split(",")]:
            for clients in [int(x) for x in (clients_list or a.clients).split(",")]:
                # the modes side by side at each client count, --repeats times in alternating order: on
                # a shared machine whose speed drifts, neighbours are what a ratio can be taken of
                reps: dict[str, list[dict]] = {m: [] for m in modes}
                for rep in range(a.repeats):
                    for mode in (modes if rep % 2 == 0 else modes[::-1]):
                        reps[mode].append(point(stack.url, ps, a, clients, temperature, mode,
                                                stack.pids(), stack.metrics))
                for mode in modes:
                    runs = reps[mode]
                    p = dict(sorted(runs, key=lambda x: x["tokens_per_s"])[(len(runs) - 1) // 2])  # median
                    p.update(mode=mode, temperature=temperature)
                    if len(runs) > 1:
                        p["repeat_tokens_per_s"] = [round(x["tokens_per_s"], 3) for x in runs]
                        p["repeat_cpu_ms_per_token"] = [x.get("cpu_ms_per_token") for x in runs]
                        p["repeat_rows_per_forward"] = [x.get("rows_per_forward") for x in runs]
                        p["repeat_spans"] = [(x["started_at"], x["ended_at"]) for x in runs]
                    if mode != "target" and "target" in reps:
                        pairs = zip(runs, reps["target"], strict=True)
                        p["paired_spec_target"] = [round(x["tokens_per_s"] / y["tokens_per_s"], 3)
                                                   for x, y in pairs if y["tokens_per_s"]]
                    if temperature == 0.0:
                        first = alone.setdefault((mode, temperature),
                                                 {i % len(ps): t for i, t in runs[0]["texts"].items()})
                        same = [t == first.get(i % len(ps)) for x in runs for i, t in x["texts"].items()
                                if i % len(ps) in first]
                        p["greedy_identical"] = f"{sum(same)}/{len(same)}"
                    elif mode == "spec" and "target" in reps and not a.unseeded:
                        # a seeded request with coupled draws gets the target-only text whatever is
                        # drafted (bf16: batch rounding may still part them)
                        same = [t == y["texts"].get(i) for x, y in zip(runs, reps["target"], strict=True)
                                for i, t in x["texts"].items()]
                        p["seeded_same_as_target"] = f"{sum(same)}/{len(same)}"
                    del p["texts"]
                    if mode == "spec":  # what the load gates measured and keep after this point
                        p["load_gate"] = gate_state(stack.url)
                    out["points"].append(p)
                    paired = p.get("paired_spec_target")
                    print(f"[{label}] {mode:6s} T={temperature:g} clients={clients:3d}: "
                          f"{p['tokens_per_s']:7.2f} tok/s  "
                          f"p50 {p['p50_latency_s']:6.2f} s  p95 {p['p95_latency_s']:6.2f} s  "
                          f"accept {p['acceptance']:.2f}  failed {p['failed']}  "
                          f"{p.get('greedy_identical', p.get('seeded_same_as_target', ''))}"
                          + (f"  spec/target by repeat {paired}" if paired else ""), flush=True)
                    if p.get("load_gate"):
                        print(f"[{label}]        load gate: {p['load_gate']}", flush=True)
                    for x in runs:
                        print(f"[{label}]        CPU ms per token: "
                              + "  ".join(f"{k} {v:.1f}" for k, v in x.get("cpu_ms_per_token", {}).items())
                              + f"  ({x['tokens_per_s']:.2f} tok/s)"
                              + (f"  rows per forward {x['rows_per_forward']}" if x.get("rows_per_forward") else ""),
                              flush=True)
    finally:
        stack.stop()
    return out


def baseline_checkout(rev: str, tmp: Path) -> Path:
    path = tmp / f"baseline-{rev}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", "--detach", str(path), rev], check=True,
                   stdout=subprocess.DEVNULL)
    protos = sorted(str(p.relative_to(path)) for p in (path / "proto" / "crossdraft" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--python_out=.", "--grpc_python_out=.",
                    "--pyi_out=.", *protos], cwd=path, check=True)
    (path / "crossdraft" / "v1" / "__init__.py").write_text("")
    return path


def summary(res: dict) -> None:
    """Ratios measured side by side in this run: speculative vs target-only at each point, each
    version's speculative throughput vs its own at 1 client, and this checkout vs the baseline."""
    vs = res["versions"]

    def tps(v, mode, temp, c):
        return next((p["tokens_per_s"] for p in v["points"]
                     if p["mode"] == mode and p["temperature"] == temp and p["clients"] == c), None)

    for v in vs:
        for temp in sorted({p["temperature"] for p in v["points"]}):
            cs = sorted({p["clients"] for p in v["points"] if p["temperature"] == temp})
            parts = []
            for c in cs:
                s, t = tps(v, "spec", temp, c), tps(v, "target", temp, c)
                one = tps(v, "spec", temp, cs[0])
                txt = f"{c}c"
                if s and t:
                    txt += f" spec/target {s / t:.2f}x"
                    pr = next((p.get("paired_spec_target") for p in v["points"] if p["mode"] == "spec"
                               and p["temperature"] == temp and p["clients"] == c), None)
                    if pr and len(pr) > 1:
                        txt += f" (median of neighbours {statistics.median(pr):.2f}x)"
                if s and one:
                    txt += f", spec/own-{cs[0]}c {s / one:.2f}x"
                if s and len(vs) > 1 and v is vs[0]:
                    b = tps(vs[-1], "spec", temp, c)
                    if b:
                        txt += f", spec/{vs[-1]['label']} {s / b:.2f}x"
                parts.append(txt)
            print(f"[{v['label']}] T={temp:g}: " + "; ".join(parts), flush=True)


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in res["versions"]:
        keys = sorted({(p["mode"], p["temperature"]) for p in v["points"]})
        for mode, temp in keys:
            pts = [p for p in v["points"] if p["mode"] == mode and p["temperature"] == temp]
            ax.plot([p["clients"] for p in pts], [p["tokens_per_s"] for p in pts], marker="o",
                    linestyle="-" if v["label"] == "batched" else "--", label=f"{v['label']} {mode} T={temp:g}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate completion tokens/s")
    m = res["meta"]
    dt = m.get("target_dtype", m["dtype"]), m.get("drafter_dtype", m["dtype"])
    dtypes = dt[0] if dt[0] == dt[1] else f"target {dt[0]}, drafter {dt[1]}"
    ax.set_title(f"{m['drafter']} -> {m['target']} ({dtypes}, {m['cpu']})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", help="both models' dtype (unless one of the two below is given)")
    ap.add_argument("--target-dtype", default="", help="the verifier's dtype (as crossdraft up --target-dtype)")
    ap.add_argument("--drafter-dtype", default="", help="the drafter's dtype (as crossdraft up --drafter-dtype)")
    ap.add_argument("--clients", default="1,2,4,8,16,32")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--modes", default="spec,target")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-class", default="", help="only the mixed set's prompts of this class (e.g. chinese)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every point this many times, the modes side by side in alternating order; a point is "
                         "its median run, and spec/target is also given as the median of neighbours' ratios")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--baseline", default="", help="git revision of the code to compare with (run from a worktree)")
    ap.add_argument("--unseeded", action="store_true", help="sampling requests without a seed")
    ap.add_argument("--baseline-clients", default="", help="client counts for the baseline (default: --clients)")
    ap.add_argument("--baseline-modes", default="", help="modes for the baseline (default: --modes)")
    ap.add_argument("--model-args", default="", help="extra flags for this checkout's model servers")
    ap.add_argument("--unbatched", action="store_true",
                    help="also run this checkout with --batching off (same code, one forward at a time)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--keep-logs", default="", help="copy the services' logs (round logs included) to this folder")
    a = ap.parse_args()
    ps = prompts(a.prompts, a.prompt_class)
    tmp = Path(tempfile.mkdtemp(prefix="crossdraft-conc-"))
    log_dir = tmp / "logs"
    log_dir.mkdir()
    versions = [run_version("batched", ROOT, a, ps, log_dir, a.model_args.split())]
    if a.unbatched:
        versions.append(run_version("unbatched", ROOT, a, ps, log_dir, a.model_args.split() + ["--batching", "off"]))
    base = None
    if a.baseline:
        base = baseline_checkout(a.baseline, tmp)
        try:
            versions.append(run_version(f"before ({a.baseline})", base, a, ps, log_dir, [], a.baseline_clients,
                                        a.baseline_modes))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    res = {"meta": {"target": a.target, "drafter": a.drafter, "dtype": a.dtype, "cpu": _cpu_name(),
                    "target_dtype": a.target_dtype or a.dtype, "drafter_dtype": a.drafter_dtype or a.dtype,
                    "cpus": os.cpu_count(), "python": platform.python_version(), "max_new_tokens": a.max_new_tokens,
                    "prompts": len(ps), "prompt_class": a.prompt_class, **git_commit(), "baseline": a.baseline,
                    "unbatched": a.unbatched,
                    "seeded_sampling": not a.unseeded, "repeats": a.repeats,
                    "time": time.strftime("%Y-%m-%d %H:%M")},
           "versions": versions}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = result_name(a.tag or f"concurrency-{a.drafter or 'none'}-{a.target}")  # filed per machine class
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1))
    print(f"wrote {out / (tag + '.json')}", flush=True)
    summary(res)
    if plot(res, out / f"{tag}.png"):
        print(f"wrote {out / (tag + '.png')}", flush=True)
    if a.keep_logs:
        shutil.copytree(log_dir, a.keep_logs, dirs_exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
