"""crossdraft.serving.up: the `crossdraft up` supervisor, with fake children instead of real models.

The fakes are tiny Python scripts serving the same health endpoints the real services do: the
standard gRPC health service (drafter, verifier) and HTTP /readyz (gateway).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import signal
import sys
import textwrap
import threading
import time

import psutil
import pytest
import redis
import requests

from crossdraft.serving import up
from crossdraft.serving.redis_server import RedisServer
from crossdraft.serving.up import Stack, StackError, UpConfig, child_commands, resolve_ports

pytestmark = pytest.mark.timeout(120)

GRPC_CHILD = """
import sys, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

port, delay = int(sys.argv[1]), float(sys.argv[2])
server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
servicer = health.HealthServicer()
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
server.add_insecure_port(f"127.0.0.1:{port}")
server.start()
print("grpc fake listening on", port, "args", sys.argv[3:], flush=True)
time.sleep(delay)  # "loading the model"
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
server.wait_for_termination()
"""

HTTP_CHILD = """
import sys, http.server

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/readyz" else 404)
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
print("http fake listening", flush=True)
srv.serve_forever()
"""

FAIL_CHILD = """
import sys
print("loading model /nope ...", flush=True)
print("FileNotFoundError: model directory /nope does not exist", file=sys.stderr, flush=True)
sys.exit(3)
"""

STUBBORN_CHILD = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
exec(open(sys.argv[2]).read().replace("sys.argv[1]", sys.argv[1]))
"""


@pytest.fixture
def scripts(tmp_path):
    paths = {}
    for name, src in [("grpc", GRPC_CHILD), ("http", HTTP_CHILD), ("fail", FAIL_CHILD), ("stubborn", STUBBORN_CHILD)]:
        p = tmp_path / f"fake_{name}.py"
        p.write_text(textwrap.dedent(src))
        paths[name] = str(p)
    return paths


def fake_commands(scripts, *, fail=None, stubborn=None, delay=0.3, seen=None):
    """A stand-in for child_commands: same names and ports, fake processes."""

    def commands(cfg: UpConfig) -> dict[str, list[str]]:
        if seen is not None:
            seen.append(cfg)
        real = child_commands(cfg)  # keeps the real validation (resolved ports, Redis URL)
        py = sys.executable
        cmds = {}
        if "drafter" in real:
            cmds["drafter"] = [py, scripts["grpc"], str(cfg.drafter_port), str(delay), *real["drafter"][3:]]
        cmds["verifier"] = [py, scripts["grpc"], str(cfg.verifier_port), str(delay), *real["verifier"][3:]]
        cmds["gateway"] = [py, scripts["http"], str(cfg.http_port)]
        if fail:
            cmds[fail] = [py, scripts["fail"]]
        if stubborn == "gateway":
            cmds["gateway"] = [py, scripts["stubborn"], str(cfg.http_port), scripts["http"]]
        return cmds

    return commands


def free_cfg(tmp_path, **kw) -> UpConfig:
    base = dict(http_port=0, grpc_port=0, drafter_port=0, verifier_port=0, log_dir=str(tmp_path / "logs"),
                ready_timeout_s=60, stop_timeout_s=5)  # fmt: skip
    base.update(kw)
    return UpConfig(**base)


def alive(pid: int) -> bool:
    if not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- child_commands / config -------------------------------------------------------------------


def test_child_commands_flags_and_ports():
    cfg = UpConfig(target="T", drafter="D", device="cuda:1", target_dtype="bfloat16", drafter_dtype="float32",
                   drafter_port=6001, verifier_port=6002, http_port=8123, grpc_port=6051,
                   redis_url="redis://127.0.0.1:7000/0", python="/py")  # fmt: skip
    cmds = child_commands(cfg)
    assert list(cmds) == ["drafter", "verifier", "gateway"]
    assert cmds["drafter"] == ["/py", "-m", "drafter", "--model", "D", "--host", "127.0.0.1", "--port", "6001",
                               "--device", "cuda:1", "--dtype", "float32"]  # fmt: skip
    assert cmds["verifier"] == ["/py", "-m", "verifier", "--model", "T", "--host", "127.0.0.1", "--port", "6002",
                                "--device", "cuda:1", "--dtype", "bfloat16"]  # fmt: skip
    assert cmds["gateway"] == ["/py", "-m", "gateway", "--drafter", "127.0.0.1:6001", "--verifier", "127.0.0.1:6002",
                               "--redis-url", "redis://127.0.0.1:7000/0", "--host", "127.0.0.1",
                               "--http-port", "8123", "--grpc-port", "6051",
                               "--drafter-start-wait-s", "900"]  # fmt: skip


def test_child_commands_defaults_and_no_drafter():
    cfg = UpConfig(target="T", drafter=None, redis_url="redis://r:1/0")
    cmds = child_commands(cfg)
    assert list(cmds) == ["verifier", "gateway"]
    assert cmds["verifier"][0] == sys.executable
    assert cmds["verifier"][3:] == ["--model", "T", "--host", "127.0.0.1", "--port", "50062"]  # no device/dtype
    gw = cmds["gateway"]
    assert "--drafter" not in gw
    assert gw[gw.index("--verifier") + 1] == "127.0.0.1:50062"
    assert gw[gw.index("--http-port") + 1] == "8000" and gw[gw.index("--grpc-port") + 1] == "50051"


def test_child_commands_needs_resolved_config():
    with pytest.raises(ValueError, match="redis_url"):
        child_commands(UpConfig())
    with pytest.raises(ValueError, match="http_port"):
        child_commands(UpConfig(redis_url="redis://x:1/0", http_port=0))
    with pytest.raises(ValueError, match="distinct"):
        child_commands(UpConfig(redis_url="redis://x:1/0", http_port=50051))


def test_resolve_ports_picks_distinct_free_ports():
    cfg = resolve_ports(UpConfig(http_port=0, grpc_port=0, drafter_port=0, verifier_port=9999))
    ports = [cfg.http_port, cfg.grpc_port, cfg.drafter_port, cfg.verifier_port]
    assert all(ports) and len(set(ports)) == 4 and cfg.verifier_port == 9999


def test_arguments_and_config(monkeypatch):
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    a = p.parse_args([])
    cfg = up.config_from_args(a, environ={})
    assert cfg == UpConfig()  # CLI defaults are the dataclass defaults
    assert cfg.ready_timeout_s == 900 and cfg.redis_url is None
    a = p.parse_args(["--target", "T", "--no-drafter", "--http-port", "0", "--device", "cpu",
                      "--target-dtype", "float32", "--ready-timeout-s", "5", "--log-dir", "/tmp/x"])  # fmt: skip
    cfg = up.config_from_args(a, environ={"REDIS_URL": "redis://h:6379/2"})
    assert (cfg.target, cfg.drafter, cfg.http_port, cfg.device, cfg.target_dtype) == ("T", None, 0, "cpu", "float32")
    assert (cfg.ready_timeout_s, cfg.log_dir, cfg.redis_url) == (5.0, "/tmp/x", "redis://h:6379/2")
    with pytest.raises(SystemExit):
        p.parse_args(["--http-port", "70000"])


def test_child_commands_placement_per_model_and_pipeline():
    """--drafter-device / --verifier-device override --device per model; --drafter-cpus /
    --verifier-cpus become each model server's --cpus (in list form); --pipeline goes to the gateway
    only, and so do --load-gate and --branch; the gateway gets no --cpus (it stays unpinned)."""
    cfg = UpConfig(target="T", drafter="D", device="cpu", drafter_device="cuda:0", verifier_device="cuda:1",
                   drafter_cpus=(0,), verifier_cpus=(1, 2, 3, 5), pipeline="on", load_gate="off", branch="on",
                   drafter_port=6001,
                   verifier_port=6002, http_port=8123, grpc_port=6051, redis_url="redis://127.0.0.1:7000/0",
                   python="/py")  # fmt: skip
    cmds = child_commands(cfg)
    assert cmds["drafter"] == ["/py", "-m", "drafter", "--model", "D", "--host", "127.0.0.1", "--port", "6001",
                               "--device", "cuda:0", "--cpus", "0"]  # fmt: skip
    assert cmds["verifier"] == ["/py", "-m", "verifier", "--model", "T", "--host", "127.0.0.1", "--port", "6002",
                                "--device", "cuda:1", "--cpus", "1-3,5"]  # fmt: skip
    assert cmds["gateway"][-6:] == ["--pipeline", "on", "--load-gate", "off", "--branch", "on"]
    assert "--cpus" not in cmds["gateway"] and "--device" not in cmds["gateway"]
    # one override only: the other model keeps --device
    cmds = child_commands(UpConfig(device="cuda", verifier_device="cuda:1", redis_url="redis://r:1/0"))
    assert cmds["drafter"][cmds["drafter"].index("--device") + 1] == "cuda"
    assert cmds["verifier"][cmds["verifier"].index("--device") + 1] == "cuda:1"
    # an override without --device
    cmds = child_commands(UpConfig(drafter_device="cuda:0", redis_url="redis://r:1/0"))
    assert cmds["drafter"][cmds["drafter"].index("--device") + 1] == "cuda:0" and "--device" not in cmds["verifier"]
    # none of the new flags: the command lines of today
    cmds = child_commands(UpConfig(redis_url="redis://r:1/0"))
    assert all("--cpus" not in c and "--pipeline" not in c and "--device" not in c and "--load-gate" not in c
               for c in cmds.values())


def test_placement_and_pipeline_arguments(capsys):
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    a = p.parse_args(["--drafter-cpus", "0", "--verifier-cpus", "1,0", "--drafter-device", "cuda:0",
                      "--verifier-device", "cuda:1", "--pipeline", "off"])  # fmt: skip
    cfg = up.config_from_args(a, environ={})
    assert (cfg.drafter_cpus, cfg.verifier_cpus) == ((0,), (0, 1))
    assert (cfg.drafter_device, cfg.verifier_device, cfg.pipeline) == ("cuda:0", "cuda:1", "off")
    cfg = up.config_from_args(p.parse_args([]), environ={})
    assert (cfg.drafter_cpus, cfg.verifier_cpus, cfg.drafter_device, cfg.verifier_device, cfg.pipeline) == \
        ((), (), None, None, None)
    have = sorted(os.sched_getaffinity(0))
    for flag, value, message in [
        ("--drafter-cpus", "", "--drafter-cpus: must name at least one CPU"),
        ("--verifier-cpus", "-1", "--verifier-cpus: CPU numbers must be >= 0"),
        ("--drafter-cpus", "zero", "--drafter-cpus: must be a list of CPU numbers"),
        ("--verifier-cpus", str(have[-1] + 1), f"--verifier-cpus: CPU {have[-1] + 1} is not available here"),
        ("--pipeline", "sometimes", "invalid choice: 'sometimes'"),
    ]:
        with pytest.raises(SystemExit) as e:
            p.parse_args([flag, value])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: " in err and message in err, err


def test_model_servers_metrics_ports():
    """--drafter-metrics-port / --verifier-metrics-port become each model server's --metrics-port (off
    by default); they must differ from every other port."""
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    cfg = up.config_from_args(p.parse_args(["--drafter-metrics-port", "9101", "--verifier-metrics-port", "9102"]),
                              environ={})
    cmds = child_commands(dataclasses.replace(cfg, redis_url="redis://r:1/0"))
    assert cmds["drafter"][cmds["drafter"].index("--metrics-port") + 1] == "9101"
    assert cmds["verifier"][cmds["verifier"].index("--metrics-port") + 1] == "9102"
    assert "--metrics-port" not in cmds["gateway"]
    assert all("--metrics-port" not in c for c in child_commands(UpConfig(redis_url="redis://r:1/0")).values())
    with pytest.raises(ValueError, match="distinct"):
        child_commands(UpConfig(redis_url="redis://r:1/0", drafter_metrics_port=8000))
    with pytest.raises(SystemExit):
        p.parse_args(["--verifier-metrics-port", "70000"])


# -- Stack with fake children ------------------------------------------------------------------


def test_stack_starts_waits_and_stops_everything(monkeypatch, scripts, tmp_path):
    monkeypatch.delenv("REDIS_URL", raising=False)
    seen = []
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts, seen=seen))
    out = io.StringIO()
    stack = Stack(free_cfg(tmp_path, device="cpu"), out=out).start()
    try:
        assert set(stack.children) == {"drafter", "verifier", "gateway"}
        assert stack.redis is not None and stack.redis.running
        cfg = seen[0]
        assert cfg.redis_url == stack.redis.url and cfg.http_port and cfg.drafter_port
        assert redis.Redis.from_url(cfg.redis_url).ping()
        stack.wait_ready(timeout_s=30)
        assert requests.get(f"http://127.0.0.1:{cfg.http_port}/readyz", timeout=2).status_code == 200
        assert stack.rest_url == f"http://127.0.0.1:{cfg.http_port}/v1"
        assert stack.grpc_target == f"127.0.0.1:{cfg.grpc_port}"
        assert stack.poll() is None
        # logs: one file per child in log_dir, printed
        for name in stack.children:
            assert stack.log_paths[name] == tmp_path / "logs" / f"{name}.log"
            assert str(stack.log_paths[name]) in out.getvalue()
        assert "--device" in stack.log_paths["drafter"].read_text()  # real args passed through
        banner = up.banner(stack)
        assert stack.rest_url in banner and stack.grpc_target in banner and "Ctrl-C to stop" in banner
        assert f"{stack.rest_url}/completions" in banner
        pids = [p.pid for p in stack.children.values()] + [stack.redis.pid]
    finally:
        stack.stop()
    assert not any(alive(pid) for pid in pids)
    assert not stack.redis.running
    stack.stop()  # idempotent


def test_stack_no_drafter_and_external_redis(monkeypatch, scripts, tmp_path):
    with RedisServer() as ext:
        seen = []
        monkeypatch.setattr(up, "child_commands", fake_commands(scripts, seen=seen))
        stack = Stack(free_cfg(tmp_path, drafter=None, redis_url=ext.url), out=io.StringIO())
        with stack:
            assert stack.redis is None and seen[0].redis_url == ext.url
            assert set(stack.children) == {"verifier", "gateway"}
            stack.wait_ready(timeout_s=30)
        assert ext.running  # an external Redis is not ours to stop


def test_child_that_exits_fails_with_log_tail(monkeypatch, scripts, tmp_path):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts, fail="verifier"))
    stack = Stack(free_cfg(tmp_path), out=io.StringIO()).start()
    with pytest.raises(StackError) as ei:
        stack.wait_ready(timeout_s=30)
    msg = str(ei.value)
    assert "verifier exited with code 3" in msg
    assert "model directory /nope does not exist" in msg
    assert isinstance(ei.value, up.ChildExited) and ei.value.returncode == 3
    # wait_ready stopped everything on its way out
    assert not any(alive(p.pid) for p in stack.children.values())
    assert not stack.redis.running


def test_wait_ready_times_out_with_details(monkeypatch, scripts, tmp_path):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts, delay=60))
    stack = Stack(free_cfg(tmp_path), out=io.StringIO()).start()
    with pytest.raises(StackError, match=r"not ready after 3s: drafter, verifier") as ei:
        stack.wait_ready(timeout_s=3)
    assert "grpc fake listening" in str(ei.value)
    assert not any(alive(p.pid) for p in stack.children.values())


def test_stop_kills_a_child_that_ignores_sigterm(monkeypatch, scripts, tmp_path):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts, stubborn="gateway"))
    stack = Stack(free_cfg(tmp_path, stop_timeout_s=1), out=io.StringIO()).start()
    stack.wait_ready(timeout_s=30)
    pid = stack.children["gateway"].pid
    t0 = time.monotonic()
    stack.stop()
    # a liveness bound, not a speed check: the stop returns (SIGKILL after the 1 s stop timeout,
    # about 1 s in all) instead of waiting on a child that ignores SIGTERM; 15 s is over 10x that
    assert time.monotonic() - t0 < 15
    assert not alive(pid)
    assert stack.children["gateway"].returncode == -signal.SIGKILL


def test_port_in_use_is_reported(monkeypatch, scripts, tmp_path):
    import socket

    monkeypatch.setattr(up, "child_commands", fake_commands(scripts))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        stack = Stack(free_cfg(tmp_path, http_port=busy, redis_url="redis://127.0.0.1:1/0"), out=io.StringIO())
        with pytest.raises(StackError, match=f"gateway REST port 127.0.0.1:{busy} is already in use"):
            stack.start()
        assert not stack.children


# -- main() ------------------------------------------------------------------------------------


def _args(tmp_path):
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    argv = ["--http-port", "0", "--grpc-port", "0", "--drafter-port", "0", "--verifier-port", "0",
            "--ready-timeout-s", "60", "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    return p.parse_args(argv)


def _when_ready(monkeypatch, action):
    """Run ``action`` in a thread once main() prints its banner (everything healthy)."""
    ready = threading.Event()
    real_banner = up.banner

    def banner(stack):
        ready.set()
        return real_banner(stack)

    monkeypatch.setattr(up, "banner", banner)

    def run():
        if ready.wait(60):
            time.sleep(0.5)  # main() is in its watch loop now
            action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_main_runs_until_sigint_then_stops_everything(monkeypatch, scripts, tmp_path, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    started = []
    real_start = Stack.start

    def start(self):
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs as a background job
    t = _when_ready(monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    rc = up.main(_args(tmp_path))
    t.join(5)
    assert rc == 0
    out = capsys.readouterr().out
    assert "Ctrl-C to stop" in out and "/v1" in out and "curl" in out
    stack = started[0]
    assert not any(alive(p.pid) for p in stack.children.values())
    assert not stack.redis.running
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before main() is restored


def test_main_exits_1_when_a_child_dies(monkeypatch, scripts, tmp_path, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    started = []
    real_start = Stack.start

    def start(self):
        started.append(self)
        return real_start(self)

    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts))
    t = _when_ready(monkeypatch, lambda: started[0].children["verifier"].kill())
    rc = up.main(_args(tmp_path))
    t.join(5)
    assert rc == 1
    assert "verifier exited with code -9" in capsys.readouterr().err
    stack = started[0]
    assert not any(alive(p.pid) for p in stack.children.values())
    assert not stack.redis.running


def test_main_fails_fast_when_a_child_cannot_start(monkeypatch, scripts, tmp_path, capsys):
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setattr(up, "child_commands", fake_commands(scripts, fail="drafter"))
    t0 = time.monotonic()
    rc = up.main(_args(tmp_path))
    # a liveness bound, not a speed check: the failed child ends the wait at once (about a second
    # with these scripts), while a main that missed it would wait out the 60 s ready timeout
    assert rc == 1 and time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "drafter exited with code 3" in err and "does not exist" in err
