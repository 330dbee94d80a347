"""Helpers for service tests: tiny random models saved as real HF directories, free ports, real
server processes (python -m drafter / verifier / gateway) started and stopped, and
:class:`Services`, the stack builder the e2e files share (Redis plus those processes, stopped
together)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]


def save_tiny_pair(out: Path) -> tuple[Path, Path]:
    """A qwen2-style target (byte-level BPE) and a llama-style drafter (SentencePiece-like) on disk."""
    from tests.tiny_models import tiny_lm
    from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer, sentencepiece_like_tokenizer

    t_dir, d_dir = out / "tiny-target", out / "tiny-drafter"
    if not (t_dir / "config.json").exists():
        tok_t = bytelevel_bpe_tokenizer()
        tok_d = sentencepiece_like_tokenizer()
        t = tiny_lm(tok_t, seed=1, arch="qwen2", extra_vocab=7)
        d = tiny_lm(tok_d, seed=2)
        for lm, path in ((t, t_dir), (d, d_dir)):
            if lm.tokenizer.eos_token_id is not None:
                lm.model.config.eos_token_id = int(lm.tokenizer.eos_token_id)
                lm.model.generation_config.eos_token_id = int(lm.tokenizer.eos_token_id)
            lm.model.save_pretrained(path)
            lm.tokenizer.save_pretrained(path)
    return t_dir, d_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A service process with its log; stop() = SIGTERM then SIGKILL; kill() = SIGKILL at once.

    Its environment is this process's (so $CROSSDRAFT_HOME is the test session's temporary one,
    tests/conftest.py) plus ``env``; start() after a stop() or kill() starts it again with ``self.env``."""

    def __init__(self, name: str, args: list[str], log_dir: Path, env: dict | None = None):
        self.name, self.args = name, args
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.p = None

    def start(self) -> "Proc":
        self.log = open(self.log_path, "ab")
        self.p = subprocess.Popen([sys.executable, "-m", *self.args], cwd=ROOT, stdout=self.log,
                                  stderr=subprocess.STDOUT, env=self.env)
        return self

    def alive(self) -> bool:
        return self.p is not None and self.p.poll() is None

    def stop(self, timeout: float = 10) -> None:
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()

    def kill(self) -> None:
        if self.alive():
            self.p.kill()
            self.p.wait()

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""


def wait_grpc_healthy(addr: str, proc: Proc, timeout: float = 120) -> None:
    from crossdraft.serving import rpc

    t0 = time.time()
    while time.time() - t0 < timeout:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        if rpc.wait_healthy(addr, 1.0):
            return
    raise RuntimeError(f"{proc.name} not healthy after {timeout}s:\n{proc.tail()}")


def wait_http_ready(url: str, proc: Proc, timeout: float = 120) -> None:
    import requests

    t0 = time.time()
    while time.time() - t0 < timeout:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            if requests.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name} not ready after {timeout}s:\n{proc.tail()}")


def model_server(kind: str, model: str, log_dir: Path, port: int | None = None, dtype: str = "float32",
                 extra: list[str] | None = None, env: dict | None = None) -> tuple[Proc, str]:
    """A drafter or verifier process; ``env`` adds to the inherited environment (fault-injection knobs)."""
    port = port or free_port()
    p = Proc(f"{kind}-{port}", [kind, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                                *(extra or [])], log_dir, env=env).start()
    return p, f"127.0.0.1:{port}"


def gateway(verifier: str, drafter: str | None, redis_url: str, log_dir: Path, *, drafter_timeout_s: float = 10,
            env: dict | None = None, extra: list[str] | None = None) -> tuple[Proc, str, str]:
    hp, gp = free_port(), free_port()
    args = ["gateway", "--verifier", verifier, "--redis-url", redis_url, "--host", "127.0.0.1", "--http-port", str(hp),
            "--grpc-port", str(gp), "--drafter-timeout-s", str(drafter_timeout_s), "--connect-timeout-s", "120"]
    if drafter:
        args += ["--drafter", drafter]
    args += extra or []
    p = Proc(f"gateway-{hp}", args, log_dir, env=env).start()
    return p, f"http://127.0.0.1:{hp}", f"127.0.0.1:{gp}"


@dataclass
class Services:
    """A real stack under construction: a Redis server, then model servers and gateways started on
    it, each its own process on 127.0.0.1 with its log in ``log_dir``.

    Processes start when added and are waited for by :meth:`ready` (so that model servers load in
    parallel); :meth:`stop` (or leaving the ``with`` block) stops them in reverse order, then
    Redis. Use::

        with Services(logs) as s:
            v, vaddr = s.verifier(t_dir)
            d, daddr = s.drafter(d_dir)
            s.ready()
            g, http, grpc_addr = s.gateway(vaddr, daddr)
            s.ready()
            yield ...
    """

    log_dir: Path
    redis: object = None  # crossdraft.serving.redis_server.RedisServer
    procs: list[Proc] = field(default_factory=list)
    _waits: list = field(default_factory=list)  # (wait function, target, proc) of processes not yet ready

    def __post_init__(self) -> None:
        from crossdraft.serving.redis_server import RedisServer

        self.redis = RedisServer().start()

    def __enter__(self) -> "Services":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _model_server(self, kind: str, model, extra, env) -> tuple[Proc, str]:
        p, addr = model_server(kind, str(model), self.log_dir, extra=list(extra or []), env=env)
        self.procs.append(p)
        self._waits.append((wait_grpc_healthy, addr, p))
        return p, addr

    def verifier(self, model, extra=None, env: dict | None = None) -> tuple[Proc, str]:
        """A verifier process (fp32); ``env`` adds fault-injection knobs. Returns (process, host:port)."""
        return self._model_server("verifier", model, extra, env)

    def drafter(self, model, extra=None, env: dict | None = None, quantize: str = "none") -> tuple[Proc, str]:
        """A drafter process, on fp32 float weights by default (``--quantize none``: an fp32 drafter server
        may otherwise choose int8 copies at load, by timing -- crossdraft.models.quant -- while the
        in-process engines the tests compare with keep float weights). Benchmarks pass ``quantize="auto"``:
        the server's own default, what a user's drafter runs with."""
        return self._model_server("drafter", model, ["--quantize", quantize, *(extra or [])], env)

    def gateway(self, verifier: str | list[str], drafter: str | None, **kw) -> tuple[Proc, str, str]:
        """A gateway on this stack's Redis over the verifier replica(s) and drafter given (keywords
        as :func:`gateway`). Returns (process, REST base URL, gRPC host:port)."""
        addrs = verifier if isinstance(verifier, str) else ",".join(verifier)
        p, http, grpc_addr = gateway(addrs, drafter, self.redis.url, self.log_dir, **kw)
        self.procs.append(p)
        self._waits.append((wait_http_ready, http, p))
        return p, http, grpc_addr

    def ready(self, timeout: float = 120) -> None:
        """Wait until every process added since the last call serves (gRPC health SERVING for model
        servers, /readyz 200 for gateways; the waits' bounds, `timeout` seconds each, are liveness bounds:
        benchmarks loading several fp32 models on two cores pass more)."""
        waits, self._waits = self._waits, []
        for wait, target, p in waits:
            wait(target, p, timeout=timeout)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def metric_value(http, name, labels="") -> float:
    """A Prometheus sample's value on ``http``/metrics (0.0 when it is not there yet)."""
    for line in requests.get(http + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.split()[1])
    return 0.0


def metric_settled(http, name, settle_s=0.5, timeout_s=60.0) -> float:
    """Wait until counter ``name`` stops moving (unchanged over settle_s); its value."""
    deadline = time.monotonic() + timeout_s
    last = metric_value(http, name)
    while time.monotonic() < deadline:
        time.sleep(settle_s)
        now = metric_value(http, name)
        if now == last:
            return now
        last = now
    raise AssertionError(f"{name} kept moving for {timeout_s} s")


def stream_and_kill(http: str, body: dict, proc: Proc, at_chars: int) -> tuple[str, dict | None, bool]:
    """POST a streamed completion and SIGKILL `proc` once `at_chars` characters of text have arrived in a
    chunk that does not end the stream (more rounds follow). Returns (the text streamed, the final chunk,
    whether the kill happened); an error chunk fails the calling test."""
    import json

    r = requests.post(http + "/v1/completions", json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    pieces, final, killed = [], None, False
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        assert "error" not in obj, obj
        ch = obj["choices"][0]
        pieces.append(ch["text"])
        if ch["finish_reason"]:
            final = obj
        elif not killed and len("".join(pieces)) >= at_chars:
            proc.kill()
            killed = True
    return "".join(pieces), final, killed


class TcpRelay:
    """Forwards every TCP connection to 127.0.0.1:`port` to `target` (host:port), byte for byte, from
    start() on: a server that comes up at an address a gateway was told about before it answered (the
    server behind it is a real one, already running; the relay only decides when the address answers)."""

    def __init__(self, port: int, target: str):
        import threading

        self.port, self.target = port, target
        self._stop = threading.Event()
        self._sock: socket.socket | None = None

    def start(self) -> TcpRelay:
        import threading

        self._sock = socket.create_server(("127.0.0.1", self.port))
        self._sock.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        import threading

        host, _, port = self.target.rpartition(":")
        while not self._stop.is_set():
            try:
                a, _ = self._sock.accept()
            except OSError:  # (the timeout, or the socket closed by stop())
                continue
            try:
                b = socket.create_connection((host, int(port)))
            except OSError:  # the server behind is down: so is this address
                a.close()
                continue
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            self._sock.close()
