"""What the drafter and verifier servers share: configuration, model loading, serving.

Each server binds its port at once and answers health checks NOT_SERVING while its model loads
(RPCs get UNAVAILABLE), then SERVING. SIGTERM/SIGINT stop it gracefully.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from dataclasses import dataclass

from .errors import InvalidArgument, Unavailable

log = logging.getLogger("crossdraft.server")


@dataclass(frozen=True)
class ModelServerConfig:
    """Configuration of a drafter or verifier server (flags override CROSSDRAFT_* env vars)."""

    model: str  # catalog name, local HF directory or .gguf file
    dtype: str | None = None  # float32 | bfloat16 | float16 (default: the fastest for this device)
    device: str = "cpu"  # cpu, cuda, cuda:N
    host: str = "0.0.0.0"  # address to bind
    port: int = 0  # gRPC port (0 = pick a free one, printed at start)
    max_sessions: int = 64  # KV caches kept; least recently used dropped beyond
    session_ttl_s: float = 600.0  # drop a session unused this long
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)
    max_workers: int = 16  # gRPC handler threads
    grace_s: float = 5.0  # on SIGTERM, time for in-flight RPCs to finish


def _env(name: str, default):
    return os.environ.get(f"CROSSDRAFT_{name}", default)


def add_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--model", default=_env("MODEL", None), help="catalog name, HF directory or .gguf (env CROSSDRAFT_MODEL)")
    p.add_argument("--dtype", default=_env("DTYPE", None), help="float32 | bfloat16 | float16 (env CROSSDRAFT_DTYPE)")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu | cuda | cuda:N (env CROSSDRAFT_DEVICE)")
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="bind address (env CROSSDRAFT_HOST)")
    p.add_argument("--port", type=int, default=int(_env("PORT", default_port)), help="gRPC port (env CROSSDRAFT_PORT)")
    p.add_argument("--max-sessions", type=int, default=int(_env("MAX_SESSIONS", 64)), help="KV caches kept (LRU)")
    p.add_argument("--session-ttl-s", type=float, default=float(_env("SESSION_TTL_S", 600)), help="session idle expiry")
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", 0)), help="Prometheus port (0 = off)")
    p.add_argument("--max-workers", type=int, default=int(_env("MAX_WORKERS", 16)), help="gRPC handler threads")


def config_from_args(a) -> ModelServerConfig:
    if not a.model:
        raise InvalidArgument("model", "is required (--model or CROSSDRAFT_MODEL)")
    if not 0 <= a.port < 65536:
        raise InvalidArgument("port", f"must be in [0, 65535], got {a.port}")
    if a.max_sessions < 1:
        raise InvalidArgument("max_sessions", "must be >= 1")
    if not a.session_ttl_s > 0:
        raise InvalidArgument("session_ttl_s", "must be > 0")
    return ModelServerConfig(model=a.model, dtype=a.dtype, device=a.device, host=a.host, port=a.port,
                             max_sessions=a.max_sessions, session_ttl_s=a.session_ttl_s,
                             metrics_port=a.metrics_port, max_workers=a.max_workers)


class Loading:
    """Holds the worker; RPCs arriving before the model is loaded get UNAVAILABLE."""

    def __init__(self):
        self.worker = None
        self.error: str | None = None

    def get(self):
        if self.worker is None:
            raise Unavailable(self.error or "the model is still loading")
        return self.worker


def main(kind: str, default_port: int, service_name: str, servicer, make_worker, add_servicer, argv=None) -> int:
    """`python -m drafter` / `python -m verifier`: parse flags, then :func:`serve`."""
    import sys

    from .workers import WorkerConfig

    p = argparse.ArgumentParser(prog=f"python -m {kind}", description=f"crossdraft {kind} service (gRPC)")
    add_arguments(p, default_port)
    try:
        cfg = config_from_args(p.parse_args(argv))
    except InvalidArgument as e:
        print(f"{kind}: error: {e}", file=sys.stderr)
        return 2
    wcfg = WorkerConfig(max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s)
    return serve(kind, cfg, lambda loaded: make_worker(loaded, wcfg), lambda s: add_servicer(servicer, s),
                 service_name, servicer)


def serve(kind: str, cfg: ModelServerConfig, make_worker, add_servicer, service_name: str, servicer) -> int:
    """Bind, load the model in the background, serve until SIGTERM/SIGINT. Returns an exit code."""
    from . import rpc, telemetry
    from .models import fast_dtype, load_model, parse_device

    logging.basicConfig(level=os.environ.get("CROSSDRAFT_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {kind} %(levelname)s %(message)s")
    provider = telemetry.setup_tracing(f"crossdraft-{kind}")
    tracer = telemetry.get_tracer(provider, f"crossdraft.{kind}")
    server, port, health = rpc.build_server([add_servicer], [service_name], cfg.host, cfg.port,
                                            max_workers=cfg.max_workers, tracer=tracer)
    server.start()
    rpc.start_metrics_server(cfg.metrics_port)
    print(f"crossdraft {kind}: listening on {cfg.host}:{port} (loading {cfg.model})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def load():
        try:
            device = parse_device(cfg.device)
            dtype = fast_dtype(device) if cfg.dtype in (None, "", "auto") else cfg.dtype
            loaded = load_model(cfg.model, device=device, dtype=dtype, progress=False)
            worker = make_worker(loaded)
            ms = worker.timings()  # timed once here (or read from the cost cache), not on a request's path
            if ms:
                print(f"crossdraft {kind}: forward of 1 token {ms[0]:.1f} ms, of {len(ms)} tokens {ms[-1]:.1f} ms", flush=True)
            servicer.state.worker = worker
            rpc.set_serving(health, ["", service_name], True)
            print(f"crossdraft {kind}: serving {loaded.name} ({dtype}) on {cfg.host}:{port}", flush=True)
        except Exception as e:  # keep answering health (NOT_SERVING) so the failure is visible
            servicer.state.error = f"model failed to load: {type(e).__name__}: {e}"
            log.error(servicer.state.error)
            stop.set()

    threading.Thread(target=load, daemon=True).start()
    stop.wait()
    rpc.set_serving(health, ["", service_name], False)
    server.stop(cfg.grace_s).wait()
    try:
        provider.shutdown()
    except Exception:
        pass
    return 1 if servicer.state.error else 0
