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
import time
from dataclasses import dataclass

from crossdraft.argtypes import cpu_list_arg, float_arg, format_cpu_list, int_arg, port_arg
from crossdraft.errors import InvalidArgument, Unavailable
from crossdraft.serving.tls import TLSConfig

log = logging.getLogger("crossdraft.server")


@dataclass(frozen=True)
class ModelServerConfig:
    """Configuration of a drafter or verifier server (flags override CROSSDRAFT_* env vars)."""

    model: str  # catalog name, local HF directory, .gguf file or Hub id org/name[@revision]
    dtype: str | None = None  # float32 | bfloat16 | float16 (default: the fastest for this device)
    device: str = "cpu"  # cpu, cuda, cuda:N
    host: str = "0.0.0.0"  # address to bind
    port: int = 0  # gRPC port (0 = pick a free one, printed at start)
    max_sessions: int = 64  # KV caches kept; least recently used dropped beyond
    session_ttl_s: float = 600.0  # drop a session unused this long
    metrics_port: int = 0  # Prometheus /metrics port (0 = off)
    max_workers: int = 64  # gRPC handler threads (each in-flight request holds one while it waits for its batch)
    grace_s: float = 5.0  # on SIGTERM, time for in-flight RPCs to finish
    batching: bool = True  # batch the sessions' forwards (off: one forward at a time, a cache per session)
    max_batch_rows: int = 32  # sessions in one forward at most
    max_batch_tokens: int = 4096  # tokens in one forward at most
    batch_wait_ms: float | None = None  # how long a forward may wait for more rows (None = automatic)
    prefill_chunk: int = 512  # long prefills/syncs run in chunks of this many tokens
    kv_cache_tokens: int = 0  # KV pool size in tokens (0 = automatic)
    kv_cache_memory_fraction: float = 0.0  # automatic pool size's share of free memory (0 = per device)
    cuda_graphs: bool | None = None  # batched forwards as captured CUDA graphs per shape bucket (None = on CUDA)
    tls: TLSConfig = TLSConfig()  # certificate, key, client CA: mutual TLS when set (crossdraft.serving.tls)
    health_port: int = 0  # plaintext port serving only grpc.health.v1 (probes that cannot do TLS); 0 = off
    revision: str | None = None  # Hub ids: branch, tag or commit (same as model@REV)
    model_file: str | None = None  # Hub ids: the GGUF in the repo to serve (a repo of several GGUFs)
    trust_remote_code: bool = False  # Hub ids / HF dirs: run the repo's own modelling code
    quantize: str = "auto"  # drafters: int8 weight copies for one-token steps (models.quant); verifiers: none
    cpu_linear: str = "auto"  # fp32 on a CPU: linear layers on oneDNN-packed weights if faster (models.cpulinear)
    cpus: tuple[int, ...] = ()  # pin the process to these CPUs, one torch thread each (() = unpinned)
    # CPU servers on the same cores take turns at forwards (crossdraft.runtime.turns): auto, off or a lock file
    cpu_turns: str = "auto"


def _env(name: str, default):
    return os.environ.get(f"CROSSDRAFT_{name}", default)


def _bool_env(v) -> bool:
    return str(v or "").strip().lower() in ("1", "true", "yes", "on")


def _turns(v) -> str:
    """--cpu-turns: auto, off or a lock file's path."""
    s = str(v or "").strip()
    if not s:
        raise InvalidArgument("cpu_turns", "must be auto, off or a lock file's path")
    return s.lower() if s.lower() in ("auto", "off") else s


def _wait_ms(v) -> float | None:
    """--batch-wait-ms: a number of ms, or "auto"."""
    if v is None or str(v).strip().lower() == "auto":
        return None
    try:
        return float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-wait-ms: a number of ms or 'auto', got {v!r}") from None


# one declaration per flag, in the order --help lists them: kept whole so the list reads as the manual does
def add_arguments(p: argparse.ArgumentParser, default_port: int) -> None:
    p.add_argument("--model", default=_env("MODEL", None),
                   help="catalog name, HF directory, .gguf or Hugging Face Hub id org/name[@revision] "
                        "(env CROSSDRAFT_MODEL)")
    p.add_argument("--revision", default=_env("REVISION", None) or None,
                   help="branch, tag or commit of a Hub-id model, the same as org/name@REV (env CROSSDRAFT_REVISION)")
    p.add_argument("--model-file", default=_env("MODEL_FILE", None) or None,
                   help="a Hub repo of GGUFs: the path of the GGUF to serve, for a repo holding several (the same "
                        "as org/name:QUANT with its quantisation tag) (env CROSSDRAFT_MODEL_FILE)")
    p.add_argument("--trust-remote-code", action="store_true", default=_bool_env(_env("TRUST_REMOTE_CODE", "")),
                   help="run the modelling code a Hub repo ships (off by default; env CROSSDRAFT_TRUST_REMOTE_CODE)")
    p.add_argument("--dtype", default=_env("DTYPE", None), help="float32 | bfloat16 | float16 (env CROSSDRAFT_DTYPE)")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu | cuda | cuda:N (env CROSSDRAFT_DEVICE)")
    p.add_argument("--quantize", default=_env("QUANTIZE", "auto"),
                   help="drafter only: auto | none | int8 | int4 -- low-bit copies of the weights for its few-token "
                        "steps (int8 about half the step time on a CPU, int4 about a third; drafts only, output "
                        "unchanged); auto = int4 on a CPU in bfloat16/float16. A verifier keeps exact weights: "
                        "none or auto "
                        "(env CROSSDRAFT_QUANTIZE)")
    p.add_argument("--cpu-linear", default=_env("CPU_LINEAR", "auto"),
                   help="float32 on a CPU: auto | packed | plain -- linear layers on weights packed once for "
                        "oneDNN (on some CPUs several times faster for the few-token forwards of verification; "
                        "the same numbers); auto = packed where it measures faster at load (env "
                        "CROSSDRAFT_CPU_LINEAR)")
    p.add_argument("--cpus", type=cpu_list_arg("--cpus", env="CROSSDRAFT_CPUS"), default=_env("CPUS", None) or None,
                   metavar="LIST",
                   help="run on these CPUs only, e.g. 0-3 or 0,2,4-5: the process pins itself to them and "
                        "uses one torch thread per CPU (default: every CPU, torch's own thread count) "
                        "(env CROSSDRAFT_CPUS)")
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"), help="bind address (env CROSSDRAFT_HOST)")
    p.add_argument("--port", type=port_arg("--port", env="CROSSDRAFT_PORT", zero="a free port"),
                   default=str(_env("PORT", default_port)), help="gRPC port (env CROSSDRAFT_PORT)")
    p.add_argument("--max-sessions", type=int_arg("--max-sessions", 1, env="CROSSDRAFT_MAX_SESSIONS"),
                   default=str(_env("MAX_SESSIONS", 64)), help="KV caches kept (LRU)")
    p.add_argument("--session-ttl-s", type=float_arg("--session-ttl-s", 0, above=True, env="CROSSDRAFT_SESSION_TTL_S"),
                   default=str(_env("SESSION_TTL_S", 600)), help="session idle expiry")
    p.add_argument("--metrics-port", type=port_arg("--metrics-port", env="CROSSDRAFT_METRICS_PORT", zero="off"),
                   default=str(_env("METRICS_PORT", 0)), help="Prometheus port (0 = off)")
    p.add_argument("--max-workers", type=int_arg("--max-workers", 1, env="CROSSDRAFT_MAX_WORKERS"),
                   default=str(_env("MAX_WORKERS", 64)), help="gRPC handler threads")
    p.add_argument("--batching", choices=("on", "off"), default=_env("BATCHING", "on"),
                   help="batch the sessions' forwards in one forward (env CROSSDRAFT_BATCHING)")
    p.add_argument("--max-batch-rows", type=int_arg("--max-batch-rows", 1, env="CROSSDRAFT_MAX_BATCH_ROWS"),
                   default=str(_env("MAX_BATCH_ROWS", 32)), help="sessions per forward")
    p.add_argument("--max-batch-tokens", type=int_arg("--max-batch-tokens", 1, env="CROSSDRAFT_MAX_BATCH_TOKENS"),
                   default=str(_env("MAX_BATCH_TOKENS", 4096)),
                   help="tokens per forward")
    p.add_argument("--batch-wait-ms", type=_wait_ms, default=_wait_ms(_env("BATCH_WAIT_MS", "auto")),
                   help="longest wait of a forward for more rows in flight or expected back; auto = 15%% of the "
                        "mean forward time (1-30 ms) for rows in flight, a forward's fixed cost (at most "
                        "250 ms) for sessions expected back from their clients (env CROSSDRAFT_BATCH_WAIT_MS)")
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default=_env("CUDA_GRAPHS", "auto"),
                   help="replay batched forwards of up to 16 tokens per session as CUDA graphs, one per shape "
                        "bucket; auto = on for a CUDA device; 'on' on a CPU runs the padded path without graphs "
                        "(a check, slower) (env CROSSDRAFT_CUDA_GRAPHS)")
    p.add_argument("--cpu-turns", default=_env("CPU_TURNS", "auto"), metavar="{auto,off,FILE}",
                   help="on a CPU, take turns at forwards with the other model servers computing on the same "
                        "cores (one forward at a time, each at its speed alone, instead of both slowed several "
                        "times over by threads competing for the cores); auto = with the servers of this machine "
                        "on the same CPU set (a lock file per CPU list in the temporary directory); FILE = with "
                        "the servers given the same file (containers sharing a directory) (env CROSSDRAFT_CPU_TURNS)")
    p.add_argument("--prefill-chunk", type=int_arg("--prefill-chunk", 1, env="CROSSDRAFT_PREFILL_CHUNK"),
                   default=str(_env("PREFILL_CHUNK", 512)),
                   help="long prefills run in chunks of this many tokens")
    p.add_argument("--kv-cache-tokens", type=int_arg("--kv-cache-tokens", 0, env="CROSSDRAFT_KV_CACHE_TOKENS"),
                   default=str(_env("KV_CACHE_TOKENS", 0)),
                   help="KV pool size in tokens (0 = automatic: max_sessions x min(context, 4096), capped by "
                        "--kv-cache-memory-fraction) (env CROSSDRAFT_KV_CACHE_TOKENS)")
    p.add_argument("--kv-cache-memory-fraction",
                   type=float_arg("--kv-cache-memory-fraction", 0, 1, env="CROSSDRAFT_KV_CACHE_MEMORY_FRACTION"),
                   default=str(_env("KV_CACHE_MEMORY_FRACTION", 0.0)),
                   help="the automatic KV pool's share of the memory free at startup (0 = 0.2 on CPU, 0.8 on "
                        "CUDA) (env CROSSDRAFT_KV_CACHE_MEMORY_FRACTION)")
    p.add_argument("--tls-cert-file", default=_env("TLS_CERT_FILE", ""),
                   help="serve gRPC over TLS with this certificate (PEM; re-read when it changes); needs "
                        "--tls-key-file and --tls-client-ca-file (env CROSSDRAFT_TLS_CERT_FILE)")
    p.add_argument("--tls-key-file", default=_env("TLS_KEY_FILE", ""),
                   help="the certificate's private key (PEM) (env CROSSDRAFT_TLS_KEY_FILE)")
    p.add_argument("--tls-client-ca-file", default=_env("TLS_CLIENT_CA_FILE", ""),
                   help="callers must present a certificate signed by this CA: mutual TLS "
                        "(env CROSSDRAFT_TLS_CLIENT_CA_FILE)")
    p.add_argument("--health-port", type=port_arg("--health-port", env="CROSSDRAFT_HEALTH_PORT", zero="off"),
                   default=str(_env("HEALTH_PORT", 0)),
                   help="a plaintext port that serves only gRPC health (for probes that cannot present a "
                        "certificate, e.g. the kubelet's); 0 = off (env CROSSDRAFT_HEALTH_PORT)")


def config_from_args(a) -> ModelServerConfig:
    from crossdraft.models import cpulinear
    from crossdraft.models.quant import parse_mode

    if not a.model:
        raise InvalidArgument("model", "is required (--model or CROSSDRAFT_MODEL)")
    if not 0 <= a.port < 65536:
        raise InvalidArgument("port", f"must be in [0, 65535], got {a.port}")
    if a.max_sessions < 1:
        raise InvalidArgument("max_sessions", "must be >= 1")
    if not a.session_ttl_s > 0:
        raise InvalidArgument("session_ttl_s", "must be > 0")
    cfg = ModelServerConfig(model=a.model, dtype=a.dtype, device=a.device, host=a.host, port=a.port,
                            max_sessions=a.max_sessions, session_ttl_s=a.session_ttl_s,
                            metrics_port=a.metrics_port, max_workers=a.max_workers,
                            batching=getattr(a, "batching", "on") == "on",
                            max_batch_rows=getattr(a, "max_batch_rows", 32),
                            max_batch_tokens=getattr(a, "max_batch_tokens", 4096),
                            batch_wait_ms=getattr(a, "batch_wait_ms", None),
                            prefill_chunk=getattr(a, "prefill_chunk", 512),
                            kv_cache_tokens=getattr(a, "kv_cache_tokens", 0),
                            kv_cache_memory_fraction=getattr(a, "kv_cache_memory_fraction", 0.0),
                            cuda_graphs={"on": True, "off": False}.get(getattr(a, "cuda_graphs", "auto")),
                            tls=TLSConfig(cert_file=getattr(a, "tls_cert_file", "") or "",
                                          key_file=getattr(a, "tls_key_file", "") or "",
                                          ca_file=getattr(a, "tls_client_ca_file", "") or ""),
                            health_port=getattr(a, "health_port", 0),
                            revision=getattr(a, "revision", None) or None,
                            model_file=getattr(a, "model_file", None) or None,
                            trust_remote_code=bool(getattr(a, "trust_remote_code", False)),
                            quantize=parse_mode(getattr(a, "quantize", "auto")),
                            cpu_linear=cpulinear.parse_mode(getattr(a, "cpu_linear", "auto") or "auto"),
                            cpus=tuple(getattr(a, "cpus", None) or ()),
                            cpu_turns=_turns(getattr(a, "cpu_turns", "auto")))
    batch_config(cfg)  # validates the batching flags
    cfg.tls.check_server(require_client_ca=True)
    if not 0 <= cfg.health_port < 65536:
        raise InvalidArgument("health_port", f"must be in [0, 65535], got {cfg.health_port}")
    return cfg


def quantize_for(kind: str, cfg: ModelServerConfig) -> str:
    """The quantize mode a server of `kind` loads its model with: a verifier's weights stay exact."""
    if kind == "verifier":
        if cfg.quantize in ("int8", "int4"):
            raise InvalidArgument("quantize", "a verifier keeps the target's exact weights (its output must equal "
                                              f"the target alone); only a drafter may use {cfg.quantize}")
        return "none"
    return cfg.quantize


def batch_config(cfg: ModelServerConfig, kind: str = ""):
    """The worker's BatchConfig from the server's flags."""
    from crossdraft.runtime.batching import BatchConfig

    return BatchConfig(enabled=cfg.batching, max_rows=cfg.max_batch_rows, max_tokens=cfg.max_batch_tokens,
                       max_wait_ms=cfg.batch_wait_ms, prefill_chunk=cfg.prefill_chunk,
                       kv_cache_tokens=cfg.kv_cache_tokens,
                       kv_cache_memory_fraction=cfg.kv_cache_memory_fraction, cuda_graphs=cfg.cuda_graphs,
                       cpu_turns=cfg.cpu_turns, name=kind)


def pin_cpus(cpus) -> tuple[int, int] | None:
    """Pin this process to `cpus` and size torch's thread pools to them, before a model loads.

    Every thread of the process gets the affinity (threads started later inherit it); torch gets
    one intra-op thread per CPU, and as many inter-op threads (torch allows setting those only
    before its first parallel work: a process that already did some keeps its own). Returns
    (intra-op, inter-op) threads, or None when `cpus` is empty (nothing changes).
    """
    if not cpus:
        return None
    import torch

    cpus = set(cpus)
    os.sched_setaffinity(0, cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: threads started from now on inherit the calling thread's set
        tids = []
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # a thread that ended meanwhile
            pass
    torch.set_num_threads(len(cpus))
    try:
        torch.set_num_interop_threads(len(cpus))
    except RuntimeError:
        pass
    return torch.get_num_threads(), torch.get_num_interop_threads()


def own_threads(n: int) -> None:
    """Run this thread's torch work on ``n`` threads, whatever other threads set later. torch gives a thread
    the process-wide count on its first use, so the thread's own count is read first and then set."""
    import torch

    torch.get_num_threads()
    torch.set_num_threads(n)


def one_thread() -> None:
    """The gRPC handler threads of a batching server compute on one thread each (their executor's
    initializer). Their forwards run on the scheduler's thread; what a handler computes itself
    (sampling, the acceptance test, a drafter's logits over a vocabulary) is small. A handler with
    threads of its own would start an OpenMP team of its own, and GNU OpenMP, once it manages more
    threads than there are CPUs, stops spinning between parallel regions: every region of every
    forward then waits for its threads to wake."""
    own_threads(1)


class Loading:
    """Holds the worker; RPCs arriving before the model is loaded get UNAVAILABLE."""

    def __init__(self):
        self.worker = None
        self.error: str | None = None

    def get(self):
        if self.worker is None:
            raise Unavailable(self.error or "the model is still loading")
        return self.worker


def main(kind: str, default_port: int, service_name: str, servicer, add_servicer, argv=None) -> int:
    """`python -m drafter` / `python -m verifier`: parse flags, then :func:`serve` the ``kind``'s worker
    (the services name what they are; the model runtime stays behind this shell)."""
    import sys

    from crossdraft.runtime.workers import DrafterWorker, VerifierWorker, WorkerConfig

    make_worker = {"drafter": DrafterWorker, "verifier": VerifierWorker}[kind]

    p = argparse.ArgumentParser(prog=f"python -m {kind}", description=f"crossdraft {kind} service (gRPC)")
    add_arguments(p, default_port)
    try:
        cfg = config_from_args(p.parse_args(argv))
        quantize_for(kind, cfg)
    except InvalidArgument as e:
        print(f"{kind}: error: {e}", file=sys.stderr)
        return 2
    wcfg = WorkerConfig(max_sessions=cfg.max_sessions, session_ttl_s=cfg.session_ttl_s)
    bcfg = batch_config(cfg, kind)
    return serve(kind, cfg, lambda loaded: make_worker(loaded, wcfg, bcfg), lambda s: add_servicer(servicer, s),
                 service_name, servicer)


def serve(kind: str, cfg: ModelServerConfig, make_worker, add_servicer, service_name: str, servicer) -> int:
    """Bind, load the model in the background, serve until SIGTERM/SIGINT. Returns an exit code."""
    from crossdraft.serving import rpc, telemetry

    # pinned before any server thread starts and before the model loads (its thread pools and the
    # cost table, which is keyed by the thread count, follow the CPU set)
    threads = pin_cpus(cfg.cpus)
    if threads:
        print(f"crossdraft {kind}: pinned to CPUs {format_cpu_list(cfg.cpus)}; torch threads: {threads[0]} intra-op, "
              f"{threads[1]} inter-op", flush=True)
    logging.basicConfig(level=os.environ.get("CROSSDRAFT_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {kind} %(levelname)s %(message)s")
    provider = telemetry.setup_tracing(f"crossdraft-{kind}")
    tracer = telemetry.get_tracer(provider, f"crossdraft.{kind}")
    import torch

    # the threads that compute with the server's threads: the model's load (and cost timing) here, then
    # its batched forwards on the scheduler's thread (crossdraft.runtime.batching); the handlers on one
    # each where forwards are batched (one_thread), on the server's where each runs its own
    n_threads = torch.get_num_threads()
    server, port, health = rpc.build_server([add_servicer], [service_name], cfg.host, cfg.port,
                                            max_workers=cfg.max_workers, tracer=tracer, tls=cfg.tls,
                                            require_client_auth=True,
                                            thread_init=one_thread if cfg.batching else None)
    server.start()
    health_server = None
    if cfg.health_port:
        health_server, hport = rpc.build_health_server(health, cfg.host, cfg.health_port)
        health_server.start()
        print(f"crossdraft {kind}: health (plaintext, grpc.health.v1 only) on {cfg.host}:{hport}", flush=True)
    rpc.start_metrics_server(cfg.metrics_port)
    mode = " (mutual TLS)" if cfg.tls.cert_file else ""
    print(f"crossdraft {kind}: listening on {cfg.host}:{port}{mode} (loading {cfg.model})", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    def load():
        try:
            own_threads(n_threads)
            loaded, worker, dtype = load_worker(kind, cfg, make_worker)
            servicer.state.worker = worker
            rpc.set_serving(health, ["", service_name], True)
            print(f"crossdraft {kind}: serving {_describe(loaded, dtype)} on {cfg.host}:{port}", flush=True)
        except Exception as e:  # keep answering health (NOT_SERVING) so the failure is visible
            servicer.state.error = f"model failed to load: {type(e).__name__}: {e}"
            log.error(servicer.state.error)
            stop.set()

    threading.Thread(target=load, daemon=True).start()
    stop.wait()
    rpc.set_serving(health, ["", service_name], False)
    server.stop(cfg.grace_s).wait()
    if health_server is not None:
        health_server.stop(0)
    try:
        provider.shutdown()
    except Exception:
        pass
    return 1 if servicer.state.error else 0


def load_worker(kind: str, cfg: ModelServerConfig, make_worker):
    """Load the model and build its worker, ready for a request's first call: forward costs timed,
    the token-healing table built, batch metrics exported, the load's freed memory returned to the
    system. Returns (the loaded model, the worker, its dtype)."""
    from crossdraft.models.loading import fast_dtype, load_model, parse_device
    from crossdraft.runtime import costs, memory

    # fault injection for tests: a slow model load (the port is open, health NOT_SERVING)
    delay = float(os.environ.get("CROSSDRAFT_FAULT_LOAD_DELAY_S", "0") or 0)
    if delay > 0:
        time.sleep(delay)
    device = parse_device(cfg.device)
    dtype = fast_dtype(device) if cfg.dtype in (None, "", "auto") else cfg.dtype
    # servers sharing this machine's CPUs load and time one at a time (crossdraft.runtime.costs)
    with costs.cpu_startup_lock(device):
        loaded = load_model(cfg.model, device=device, dtype=dtype, progress=False, revision=cfg.revision,
                            trust_remote_code=cfg.trust_remote_code, quantize=quantize_for(kind, cfg),
                            cpu_linear=cfg.cpu_linear, model_file=cfg.model_file)
        worker = make_worker(loaded)
        ms = worker.timings()  # timed once here (or read from the cost cache), not on a request's path
    if hasattr(worker, "token_bytes"):
        worker.token_bytes()  # a drafter's token-healing table (0.2 s for 262k ids): not on a request's path
    if ms:
        print(f"crossdraft {kind}: forward of 1 token {ms[0]:.1f} ms, of {len(ms)} tokens {ms[-1]:.1f} ms",
              flush=True)
    info = worker.batch_info()
    if info:
        print(f"crossdraft {kind}: KV pool of {info['kv_blocks_total'] * info['kv_block_size']} tokens "
              f"({worker.kv_pool_bytes / 2**20:.0f} MiB), batches of up to {worker.batch.max_rows} sessions",
              flush=True)
    export_batch_metrics(kind, worker)
    freed = memory.trim()  # the load's freed buffers back to the system (crossdraft.runtime.memory)
    res = memory.resident()
    if res:
        print(f"crossdraft {kind}: resident {res['rss'] / 2**20:.0f} MiB (anonymous "
              f"{res.get('anon', 0) / 2**20:.0f} MiB, files {res.get('file', 0) / 2**20:.0f} MiB)"
              + (f"; {freed / 2**20:.0f} MiB of freed heap returned" if freed else ""), flush=True)
    return loaded, worker, dtype


def _describe(loaded, dtype) -> str:
    """The served model as the startup line names it: name@revision (dtype, quantisation, packing)."""
    at = f"@{loaded.revision}" if loaded.revision else ""
    qd = ", int8 weights for one-token steps" if loaded.quantize == "int8" else ""
    qd += f" ({loaded.quantize_act} activations)" if getattr(loaded, "quantize_act", "") else ""
    qd += ", oneDNN-packed linear layers" if loaded.cpu_linear == "packed" else ""
    return f"{loaded.name}{at} ({dtype}{qd})"


def export_batch_metrics(kind: str, worker) -> None:
    """Prometheus: rows and tokens per batched forward, queue wait, KV pool occupancy, evictions."""
    sched = getattr(worker, "scheduler", None)
    if sched is None:
        return
    from prometheus_client import Gauge, Histogram

    rows = Histogram(f"crossdraft_{kind}_batch_rows", "Sessions per batched forward",
                     buckets=(1, 2, 4, 8, 16, 32, 64, 128))
    tokens = Histogram(f"crossdraft_{kind}_batch_tokens", "Tokens per batched forward",
                       buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384))
    wait = Histogram(f"crossdraft_{kind}_queue_wait_seconds", "Time a row waited for its batch",
                     buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5))

    def observe(n_rows, n_tokens, waits):
        rows.observe(n_rows)
        tokens.observe(n_tokens)
        for w in waits:
            wait.observe(w)

    sched.stats.observers.append(observe)
    occ = Gauge(f"crossdraft_{kind}_kv_cache_occupancy", "Share of the KV pool's blocks in use")
    occ.set_function(lambda: sched.pool.occupancy)
    used = Gauge(f"crossdraft_{kind}_kv_cache_blocks_used", "KV pool blocks in use")
    used.set_function(lambda: sched.pool.blocks_used)
    # counts so far (monotonic), read when scraped
    ev = Gauge(f"crossdraft_{kind}_kv_evicted_sessions", "Idle sessions evicted so far to free KV memory")
    ev.set_function(lambda: worker.evicted_for_memory)
    graphs = getattr(sched, "graphs", None)
    if graphs is not None:
        st = graphs.stats
        for name, text, fn in (("captured", "Shape buckets captured as CUDA graphs so far", lambda: st.captures),
                               ("replays", "Batched forwards replayed from a CUDA graph so far", lambda: st.replays),
                               ("eager", "Batched forwards that fit no graph bucket (run eagerly) so far",
                                lambda: st.eager),
                               ("enabled", "1 while CUDA graphs are on (0 once a capture failed or differed)",
                                lambda: 0 if st.disabled else 1)):
            Gauge(f"crossdraft_{kind}_cuda_graphs_{name}", text).set_function(fn)
    turns = getattr(sched, "turns", None)
    if turns is not None:
        for name, text, fn in (("taken", "Forwards run in a turn on the CPUs shared with other model servers so far",
                                lambda: turns.turns),
                               ("wait_seconds", "Seconds the forwards waited for their turn so far",
                                lambda: turns.waited_s),
                               ("forced", "Turns taken without the lock (the holder did not let go in time) so far",
                                lambda: turns.forced)):
            Gauge(f"crossdraft_{kind}_cpu_turns_{name}", text).set_function(fn)
    full = Gauge(f"crossdraft_{kind}_kv_exhausted_rows", "Rows refused so far: the KV pool was full of busy sessions")
    full.set_function(lambda: sched.stats.exhausted)
