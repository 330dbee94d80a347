"""`crossdraft up` for real: Redis, drafter, verifier and gateway processes, one request, Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import requests

from tests.service_fixtures import ROOT


def test_crossdraft_up_serves_then_stops_everything_on_ctrl_c(tiny_dirs, tmp_path):
    t_dir, d_dir = tiny_dirs
    cmd = [sys.executable, "-m", "crossdraft.cli", "up", "--target", str(t_dir), "--drafter", str(d_dir),
           "--target-dtype", "float32", "--drafter-dtype", "float32", "--http-port", "0", "--grpc-port", "0",
           "--drafter-port", "0", "--verifier-port", "0", "--log-dir", str(tmp_path), "--ready-timeout-s", "120"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("REDIS_URL", None)  # the embedded Redis
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    out = []
    try:
        t0 = time.time()
        rest = None
        while time.time() - t0 < 150:
            line = p.stdout.readline()
            if not line:
                break
            out.append(line)
            m = re.search(r"REST\s+(http://\S+)", line)
            if m:
                rest = m.group(1)
            if "Ctrl-C to stop" in line:
                break
        assert rest, "".join(out)
        children = psutil.Process(p.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        for what in ("drafter", "verifier", "gateway", "redis-server"):
            assert what in names, names
        r = requests.post(rest + "/completions", json={"prompt": "def f(x):", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        p.send_signal(signal.SIGINT)
        rest_out, _ = p.communicate(timeout=60)
        out.append(rest_out)
        assert p.returncode == 0, "".join(out)
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        for kind in ("drafter", "verifier"):  # each model server says what it holds once loaded
            log = (tmp_path / f"{kind}.log").read_text()
            m = re.search(rf"crossdraft {kind}: resident (\d+) MiB \(anonymous (\d+) MiB", log)
            assert m and 0 < int(m.group(2)) <= int(m.group(1)), log
    finally:
        if p.poll() is None:
            p.kill()
