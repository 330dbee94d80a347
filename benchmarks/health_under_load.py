"""Benchmark: how long the gateway's probes take while it generates for many clients.

The whole stack runs as separate processes on 127.0.0.1 (Redis, drafter, verifier, gateway), once
per code version named with ``--version LABEL=REV`` (REV "." = this checkout, a directory = that
checkout; any other revision is checked out into a git worktree), one version after the other in
the same run, on the same machine. At each load point (``--loads``, e.g. 0 and 64 requests in
flight) a child process keeps that many completions running (each client sends its next request
as soon as one ends): REST non-streaming, REST streaming (SSE) and gRPC Generate streams, in the
shares of ``--mix``. Once the gateway reports them all active (its ``crossdraft_active_requests``
gauge), this process probes for ``--window-s`` seconds: GET /healthz, GET /readyz (each on a new
connection, as the kubelet does) and grpc.health.v1 Check on the gateway's gRPC port, one after
the other every ``--interval-s``. It reports p50 / p99 / max latency per probe kind and load, how
many probes failed or took longer than the kubelet's default 1 s timeout, and how many requests
ended during the window (the load's throughput, for a like-for-like check of the versions).

The load runs in its own process so that the client threads' Python work does not delay this
process's probe timing.

Writes ``<out>/<tag>.json`` (meta: CPU, commits, arguments; points: latencies per version, load
and probe kind).

Usage: python benchmarks/health_under_load.py --version before=REV --version after=. \\
       [--target gemma3-270m] [--drafter smollm2-135m] [--loads 0,64] [--max-new-tokens 256] \\
       [--window-s 20] [--tiny] [--tag NAME]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import multiprocessing as mp
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench import _cpu_name, git_commit  # noqa: E402
from bench_concurrency import Service, baseline_checkout  # noqa: E402

from benchmarks.machineclass import result_name  # noqa: E402
from crossdraft.serving.redis_server import RedisServer  # noqa: E402
from tests.service_fixtures import free_port  # noqa: E402

PROMPT = "The quick brown fox"
PROBE_TIMEOUT_S = 10.0  # a probe slower than this counts as failed (and as over the 1 s kubelet default)
KUBELET_TIMEOUT_S = 1.0  # the kubelet's default probe timeoutSeconds


class GatewayStack:
    """Redis, a drafter, a verifier and a gateway of one code checkout, each its own process."""

    def __init__(self, code: Path, a, log_dir: Path):
        self.procs: list[Service] = []
        self.redis = RedisServer().start()
        dp, vp, hp, gp = free_port(), free_port(), free_port(), free_port()
        common = ["--host", "127.0.0.1", "--dtype", a.dtype, "--max-sessions", str(max(128, 2 * a.max_load))]
        self.procs.append(Service(code, "drafter", ["drafter", "--model", a.drafter, "--port", str(dp), *common],
                                  log_dir, a.threads))
        self.procs.append(Service(code, "verifier", ["verifier", "--model", a.target, "--port", str(vp), *common],
                                  log_dir, a.threads))
        self.procs.append(Service(code, "gateway", [
            "gateway", "--verifier", f"127.0.0.1:{vp}", "--drafter", f"127.0.0.1:{dp}", "--redis-url", self.redis.url,
            "--host", "127.0.0.1", "--http-port", str(hp), "--grpc-port", str(gp), "--drafter-timeout-s", "120",
            "--connect-timeout-s", "900", "--max-new-tokens-limit", str(max(4096, a.max_new_tokens))], log_dir, 1))
        self.url = f"http://127.0.0.1:{hp}"
        self.grpc = f"127.0.0.1:{gp}"
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, http.client.HTTPException):
                if http_get(self.url, "/readyz", 2.0)[0] == 200:
                    return
            dead = [f"{p.name} (exit {p.p.returncode})" for p in self.procs if p.p.poll() is not None]
            if dead:
                self.stop()
                raise RuntimeError(f"{', '.join(dead)} exited; see {log_dir}")
            time.sleep(1)
        self.stop()
        raise RuntimeError("the stack did not get ready")

    @property
    def gateway_pid(self) -> int:
        return self.procs[-1].p.pid

    def stop(self):
        for p in reversed(self.procs):
            p.stop()
        self.redis.stop()


def http_get(base: str, path: str, timeout: float) -> tuple[int, bytes]:
    """One GET on a new connection (as a kubelet probe does): (status, body)."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def gauge(base: str, name: str) -> float:
    """The value of an unlabelled gauge on the gateway's /metrics (0 when absent)."""
    _, body = http_get(base, "/metrics", 10.0)
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


# ---- the load (a child process) ----------------------------------------------------------------

def _load_main(url: str, grpc_addr: str, kinds: list[str], max_new_tokens: int, started, finished, failed):
    """Keep one request of kind kinds[i] running per client i until this process is terminated."""
    import grpc
    import requests

    from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc

    channel = grpc.insecure_channel(grpc_addr)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    body = {"prompt": PROMPT, "max_tokens": max_new_tokens, "temperature": 0}

    def count(v):
        with v.get_lock():
            v.value += 1

    def client(kind: str):
        session = requests.Session()
        while True:
            count(started)
            try:
                if kind == "grpc":
                    req = gateway_pb2.GenerateRequest(prompt=PROMPT, options=gateway_pb2.GenerationOptions(
                        max_new_tokens=max_new_tokens, temperature=0.0))
                    for _ in stub.Generate(req, timeout=3600):
                        pass
                else:
                    stream = kind == "sse"
                    with session.post(url + "/v1/completions", json=dict(body, stream=stream), stream=stream,
                                      timeout=3600) as r:
                        for _ in r.iter_content(chunk_size=None):
                            pass
                        if r.status_code != 200:
                            count(failed)
            except Exception:  # noqa: BLE001 - counted; the client goes on
                count(failed)
                time.sleep(0.5)
            count(finished)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in kinds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def load_kinds(n: int, mix: dict[str, float]) -> list[str]:
    """n request kinds in the shares of `mix` (rest / sse / grpc), rounded, summing to n."""
    out: list[str] = []
    total = sum(mix.values())
    for k, share in mix.items():
        out += [k] * round(n * share / total)
    return (out + ["rest"] * n)[:n]


class Load:
    def __init__(self, stack: GatewayStack, n: int, a):
        ctx = mp.get_context("spawn")
        self.started, self.finished, self.failed = ctx.Value("l", 0), ctx.Value("l", 0), ctx.Value("l", 0)
        self.kinds = load_kinds(n, a.mix)
        self.p = ctx.Process(target=_load_main, args=(stack.url, stack.grpc, self.kinds, a.max_new_tokens,
                                                       self.started, self.finished, self.failed), daemon=True)
        self.p.start()

    def stop(self):
        """Terminate the clients: their connections close and the gateway cancels their requests."""
        self.p.terminate()
        self.p.join(10)


# ---- the probes ----------------------------------------------------------------------------------

def probe_once(stack: GatewayStack, health_stub) -> dict[str, tuple[float, str]]:
    """One round of the three probes, one after the other: kind -> (seconds, outcome)."""
    from grpc_health.v1 import health_pb2

    out = {}
    for kind in ("healthz", "readyz", "grpc_health"):
        t0 = time.perf_counter()
        try:
            if kind == "grpc_health":
                r = health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S)
                outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            else:
                outcome = str(http_get(stack.url, "/" + kind, PROBE_TIMEOUT_S)[0])
        except Exception as e:  # noqa: BLE001 - a failed probe is a result
            outcome = f"error ({type(e).__name__})"
        out[kind] = (time.perf_counter() - t0, outcome)
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def measure_point(stack: GatewayStack, n: int, a) -> dict:
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    load = Load(stack, n, a) if n else None
    reached = True
    try:
        if load is not None:  # wait until the gateway runs all n (bounded: a gateway may never reach it)
            deadline = time.monotonic() + a.ramp_s
            while gauge(stack.url, "crossdraft_active_requests") < n:
                if time.monotonic() > deadline:
                    reached = False
                    break
                time.sleep(0.2)
        active_at_start = gauge(stack.url, "crossdraft_active_requests")
        samples: dict[str, list[tuple[float, str]]] = {"healthz": [], "readyz": [], "grpc_health": []}
        with grpc.insecure_channel(stack.grpc) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            probe_once(stack, stub)  # the channel connects; not counted
            t_start = time.monotonic()
            finished0 = load.finished.value if load else 0
            end = t_start + a.window_s
            while time.monotonic() < end:
                t0 = time.monotonic()
                for kind, s in probe_once(stack, stub).items():
                    samples[kind].append(s)
                time.sleep(max(0.0, a.interval_s - (time.monotonic() - t0)))
        finished = (load.finished.value - finished0) if load else 0
        window = time.monotonic() - t_start
        active_at_end = gauge(stack.url, "crossdraft_active_requests")
        failed = load.failed.value if load else 0
    finally:
        if load is not None:
            load.stop()
    # the cancelled requests end on the gateway before the next point starts
    deadline = time.monotonic() + 300
    while gauge(stack.url, "crossdraft_active_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    point = {"load": n, "mix": {k: (load.kinds.count(k) if load else 0) for k in ("rest", "sse", "grpc")},
             "all_active_before_window": reached, "active_at_window_start": active_at_start,
             "active_at_window_end": active_at_end, "requests_finished_in_window": finished,
             "window_s": round(window, 2), "requests_per_s": round(finished / window, 3),
             "load_requests_failed": failed, "probes": {}}
    for kind, s in samples.items():
        lat = [x for x, _ in s]
        ok = {"healthz": "200", "readyz": "200", "grpc_health": "SERVING"}[kind]
        point["probes"][kind] = {
            "n": len(s), "p50_ms": round(1e3 * pct(lat, 0.5), 2), "p99_ms": round(1e3 * pct(lat, 0.99), 2),
            "max_ms": round(1e3 * max(lat, default=0.0), 2),
            "mean_ms": round(1e3 * statistics.mean(lat), 2) if lat else 0.0,
            "over_1s": sum(x > KUBELET_TIMEOUT_S for x in lat), "not_ok": sum(o != ok for _, o in s),
            "outcomes": sorted({o for _, o in s})}
    return point


def run_version(label: str, code: Path, a, log_dir: Path) -> dict:
    print(f"[{label}] starting the stack from {code}", flush=True)
    logs = log_dir / "".join(c if c.isalnum() else "-" for c in label)
    logs.mkdir(parents=True, exist_ok=True)
    stack = GatewayStack(code, a, logs)
    out = {"label": label, "code": str(code), "points": []}
    try:
        http_get(stack.url, "/healthz", 10)
        for n in a.loads:
            p = measure_point(stack, n, a)
            out["points"].append(p)
            for kind, s in p["probes"].items():
                print(f"[{label}] load {n:3d}  {kind:11s}  p50 {s['p50_ms']:8.1f} ms  p99 {s['p99_ms']:8.1f} ms  "
                      f"max {s['max_ms']:8.1f} ms  over 1 s {s['over_1s']}/{s['n']}  not ok {s['not_ok']}",
                      flush=True)
            print(f"[{label}] load {n:3d}  active {p['active_at_window_start']:.0f} -> {p['active_at_window_end']:.0f}"
                  f" (all reached: {p['all_active_before_window']}), finished in window "
                  f"{p['requests_finished_in_window']} ({p['requests_per_s']:.2f}/s over {p['window_s']:.1f} s), "
                  f"failed {p['load_requests_failed']}", flush=True)
    finally:
        stack.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="append", default=[], metavar="LABEL=REV",
                    help="a code version to measure (REV '.' = this checkout); repeatable, measured in order")
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="tiny random-init models (the tests' pair) instead")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per model server")
    ap.add_argument("--loads", default="0,64", help="requests in flight per point")
    ap.add_argument("--mix", default="rest=40,sse=8,grpc=16", help="shares of REST, SSE and gRPC requests")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--interval-s", type=float, default=0.1)
    ap.add_argument("--ramp-s", type=float, default=120.0, help="longest wait for the load to be all active")
    ap.add_argument("--tag", default="health-under-load")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    a.tag = result_name(a.tag)  # results are filed per machine class
    a.loads = [int(x) for x in a.loads.split(",")]
    a.max_load = max(a.loads)
    a.mix = {k: float(v) for k, v in (kv.split("=") for kv in a.mix.split(","))}
    versions = [v.split("=", 1) for v in (a.version or ["this=."])]
    tmp = Path(tempfile.mkdtemp(prefix="health-under-load-"))
    if a.tiny:
        from tests.service_fixtures import save_tiny_pair

        t_dir, d_dir = save_tiny_pair(tmp)
        a.target, a.drafter = str(t_dir), str(d_dir)
        if a.max_new_tokens > 480:  # the tiny models' context is 512 positions
            ap.error("--tiny: --max-new-tokens at most 480")
    results = []
    for label, rev in versions:
        if rev == ".":
            results.append(dict(run_version(label, ROOT, a, tmp / "logs"), commit=git_commit()))
            continue
        if Path(rev).is_dir():  # a checkout prepared elsewhere (e.g. a commit plus a patch under test)
            results.append(dict(run_version(label, Path(rev).resolve(), a, tmp / "logs"), commit={"path": rev}))
            continue
        code = baseline_checkout(rev, tmp)
        try:
            sha = subprocess.run(["git", "-C", str(code), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
            results.append(dict(run_version(label, code, a, tmp / "logs"), commit={"commit": sha.strip(),
                                                                                     "dirty": False}))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(code)], check=False)
    meta = {"cpu": _cpu_name(), "cpus": len(__import__("os").sched_getaffinity(0)), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M"), **git_commit(),
            "args": {k: v for k, v in vars(a).items() if k not in ("version",)}, "versions": versions}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{a.tag}.json"
    path.write_text(json.dumps({"meta": meta, "versions": results}, indent=1) + "\n")
    print(f"wrote {path} (logs in {tmp / 'logs'})")


if __name__ == "__main__":
    main()
