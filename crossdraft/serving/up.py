"""`crossdraft up`: the whole stack on one machine, with one command.

Starts (with this Python interpreter) a drafter service, a verifier service and the gateway,
plus an embedded Redis when ``$REDIS_URL`` is unset; waits until every part reports healthy
(gRPC health ``Check("")`` = SERVING for drafter and verifier, ``GET /readyz`` = 200 for the
gateway), prints the endpoints, and runs until Ctrl-C / SIGTERM or until a child dies. Then it
stops everything it started: SIGTERM, a grace period, SIGKILL; Redis last.

Children run in their own sessions (process groups), so a terminal's Ctrl-C reaches only this
supervisor, which then shuts them down in order; signals go to the whole group, so anything a
child spawned goes with it. Child output goes to ``<log-dir>/<name>.log``.

The CLI wiring is ``add_arguments(parser)`` + ``main(args)``; the testable parts are
``UpConfig`` (what to run), ``child_commands(cfg)`` (the exact command lines) and ``Stack``
(start / wait_ready / poll / stop).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

from crossdraft.argtypes import cpu_list_arg, format_cpu_list, int_arg
from crossdraft.serving.children import GrpcHealthProbe, HttpProbe, log_tail, port_in_use, signal_group
from crossdraft.serving.redis_server import RedisServer, free_port

__all__ = [
    "ChildExited",
    "Stack",
    "StackError",
    "UpConfig",
    "add_arguments",
    "child_commands",
    "config_from_args",
    "main",
    "resolve_ports",
]

# Same defaults as `crossdraft generate` (crossdraft/cli.py); repeated here because cli.py imports
# this module.
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class UpConfig:
    """What `crossdraft up` runs. Ports 0 are replaced by free ones (``resolve_ports``)."""

    target: str = DEFAULT_TARGET  # target model (verifier): catalog name, HF directory or .gguf
    drafter: str | None = DEFAULT_DRAFTER  # drafter model; None = no drafter (target-only)
    host: str = "127.0.0.1"  # interface every service binds and is probed on
    http_port: int = 8000  # gateway REST port (0 = pick a free one)
    grpc_port: int = 50051  # gateway gRPC port (0 = pick a free one)
    drafter_port: int = 50061  # drafter gRPC port (0 = pick a free one)
    verifier_port: int = 50062  # verifier gRPC port (0 = pick a free one)
    device: str | None = None  # --device for drafter and verifier (None = their default)
    drafter_device: str | None = None  # the drafter's --device, overriding `device` (None = `device`)
    verifier_device: str | None = None  # the verifier's --device, overriding `device` (None = `device`)
    drafter_cpus: tuple[int, ...] = ()  # the drafter's --cpus: pinned to these CPUs (() = unpinned)
    verifier_cpus: tuple[int, ...] = ()  # the verifier's --cpus (() = unpinned); gateway and Redis stay unpinned
    pipeline: str | None = None  # the gateway's --pipeline auto|on|off (None = the gateway's default)
    drafter_metrics_port: int = 0  # the drafter's Prometheus --metrics-port (0 = off)
    verifier_metrics_port: int = 0  # the verifier's Prometheus --metrics-port (0 = off)
    target_dtype: str | None = None  # verifier --dtype (None = its default)
    drafter_dtype: str | None = None  # drafter --dtype (None = its default)
    target_revision: str | None = None  # verifier --revision of a Hub-id target (None = the id's own / main)
    drafter_revision: str | None = None  # drafter --revision of a Hub-id drafter
    target_file: str | None = None  # verifier --model-file: the GGUF of a Hub-id target repo holding several
    drafter_file: str | None = None  # drafter --model-file: the GGUF of a Hub-id drafter repo holding several
    trust_remote_code: bool = False  # --trust-remote-code for both model servers
    redis_url: str | None = None  # Redis for the gateway; None = start an embedded redis-server
    ready_timeout_s: float = 900.0  # how long model loading may take before giving up
    stop_timeout_s: float = 10.0  # grace period between SIGTERM and SIGKILL on shutdown
    log_dir: str | None = None  # where child logs go; None = a new temporary directory
    python: str = field(default_factory=lambda: sys.executable)  # interpreter for the children


class StackError(RuntimeError):
    """The stack could not be started or became unhealthy."""


class ChildExited(StackError):
    """A child process exited; the message carries the tail of its log."""

    def __init__(self, name: str, returncode: int, log_path: Path | None, tail: str, when: str = ""):
        self.name, self.returncode, self.log_path, self.tail = name, returncode, log_path, tail
        where = f" (log: {log_path})" if log_path else ""
        super().__init__(f"{name} exited with code {returncode}{when}{where}; last lines:\n{tail}")


# -- configuration ------------------------------------------------------------------------------


def resolve_ports(cfg: UpConfig) -> UpConfig:
    """``cfg`` with every port 0 replaced by a currently free port (all distinct)."""
    taken: set[int] = {p for p in (cfg.http_port, cfg.grpc_port, cfg.drafter_port, cfg.verifier_port) if p}
    changes = {}
    for name in ("drafter_port", "verifier_port", "grpc_port", "http_port"):
        if getattr(cfg, name) == 0:
            while (p := free_port(cfg.host)) in taken:
                pass
            taken.add(p)
            changes[name] = p
    return dataclasses.replace(cfg, **changes)


def child_commands(cfg: UpConfig) -> dict[str, list[str]]:
    """Command line of each child, in start order: drafter (unless disabled), verifier, gateway.

    Expects resolved ports and a Redis URL (``Stack.start`` provides both).
    """
    if cfg.redis_url is None:
        raise ValueError("child_commands needs cfg.redis_url (Stack.start fills it in)")
    ports = {"http_port": cfg.http_port, "grpc_port": cfg.grpc_port, "verifier_port": cfg.verifier_port}
    ports.update({k: getattr(cfg, k) for k in ("drafter_metrics_port", "verifier_metrics_port") if getattr(cfg, k)})
    if cfg.drafter is not None:
        ports["drafter_port"] = cfg.drafter_port
    for name, port in ports.items():
        if not 0 < port < 65536:
            raise ValueError(f"{name} must be resolved to a port in 1..65535, got {port}")
    if len(set(ports.values())) != len(ports):
        raise ValueError(f"ports must be distinct: {ports}")

    def model_args(model: str, port: int, dtype: str | None, revision: str | None, model_file: str | None,
                   device: str | None, cpus: tuple[int, ...], metrics_port: int) -> list[str]:
        args = ["--model", model, "--host", cfg.host, "--port", str(port)]
        if metrics_port:
            args += ["--metrics-port", str(metrics_port)]
        if device or cfg.device:
            args += ["--device", device or cfg.device]
        if cpus:
            args += ["--cpus", format_cpu_list(cpus)]
        if dtype:
            args += ["--dtype", dtype]
        if revision:
            args += ["--revision", revision]
        if model_file:
            args += ["--model-file", model_file]
        if cfg.trust_remote_code:
            args += ["--trust-remote-code"]
        return args

    cmds: dict[str, list[str]] = {}
    if cfg.drafter is not None:
        cmds["drafter"] = [cfg.python, "-m", "drafter",
                           *model_args(cfg.drafter, cfg.drafter_port, cfg.drafter_dtype, cfg.drafter_revision,
                                      cfg.drafter_file, cfg.drafter_device, cfg.drafter_cpus,
                                      cfg.drafter_metrics_port)]
    cmds["verifier"] = [cfg.python, "-m", "verifier",
                        *model_args(cfg.target, cfg.verifier_port, cfg.target_dtype, cfg.target_revision,
                                   cfg.target_file, cfg.verifier_device, cfg.verifier_cpus,
                                   cfg.verifier_metrics_port)]
    gateway = [cfg.python, "-m", "gateway"]
    if cfg.drafter is not None:
        gateway += ["--drafter", f"{cfg.host}:{cfg.drafter_port}"]
    gateway += [
        "--verifier", f"{cfg.host}:{cfg.verifier_port}",
        "--redis-url", cfg.redis_url,
        "--host", cfg.host,
        "--http-port", str(cfg.http_port),
        "--grpc-port", str(cfg.grpc_port),
    ]  # fmt: skip
    if cfg.pipeline:
        gateway += ["--pipeline", cfg.pipeline]
    cmds["gateway"] = gateway
    return cmds


def _port_arg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {s!r}") from None
    if not 0 <= v < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535 (0 = pick a free one), got {v}")
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {v}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `crossdraft up`."""
    d = UpConfig()
    parser.add_argument("--target", default=d.target,
                        help="target model: catalog name, HF directory, .gguf or Hub id org/name[@revision]")
    parser.add_argument("--drafter", default=d.drafter,
                        help="drafter model: catalog name, HF directory, .gguf or Hub id org/name[@revision]")
    parser.add_argument("--target-revision", default=None, help="branch, tag or commit of a Hub-id target")
    parser.add_argument("--drafter-revision", default=None, help="branch, tag or commit of a Hub-id drafter")
    parser.add_argument("--target-file", default=None,
                        help="the GGUF to serve of a Hub-id target repo holding several (its path in the repo; "
                             "or name its quantisation tag: org/name:Q4_K_M)")
    parser.add_argument("--drafter-file", default=None,
                        help="the GGUF to serve of a Hub-id drafter repo holding several (its path in the repo)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let both model servers run a Hub repo's own code (off by default)")
    parser.add_argument("--no-drafter", action="store_true", help="run target-only: no drafter service")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N for both models (default: the services' own)")
    parser.add_argument("--drafter-device", default=None,
                        help="the drafter's device, overriding --device (e.g. cuda:0 beside --verifier-device cuda:1)")
    parser.add_argument("--verifier-device", default=None, help="the verifier's device, overriding --device")
    parser.add_argument("--drafter-cpus", type=cpu_list_arg("--drafter-cpus"), default=None, metavar="LIST",
                        help="pin the drafter to these CPUs, e.g. 0 or 0-3 or 0,2,4-5, with one torch thread each "
                             "(its --cpus; default: unpinned)")
    parser.add_argument("--verifier-cpus", type=cpu_list_arg("--verifier-cpus"), default=None, metavar="LIST",
                        help="pin the verifier to these CPUs (its --cpus; default: unpinned). The gateway and "
                             "Redis stay unpinned")
    parser.add_argument("--pipeline", choices=("auto", "on", "off"), default=None,
                        help="the gateway's --pipeline: draft the next block while the verifier checks this one "
                             "(default: the gateway's own)")
    parser.add_argument("--target-dtype", default=None, help="verifier dtype (default: the service's own)")
    parser.add_argument("--drafter-dtype", default=None, help="drafter dtype (default: the service's own)")
    parser.add_argument("--http-port", type=_port_arg, default=d.http_port, help="gateway REST port (0 = free port)")
    parser.add_argument("--grpc-port", type=_port_arg, default=d.grpc_port, help="gateway gRPC port (0 = free port)")
    parser.add_argument("--drafter-port", type=_port_arg, default=d.drafter_port,
                        help="drafter gRPC port (0 = free port)")
    parser.add_argument("--verifier-port", type=_port_arg, default=d.verifier_port,
                        help="verifier gRPC port (0 = free port)")
    parser.add_argument("--drafter-metrics-port", type=int_arg("--drafter-metrics-port", 0, 65535), default=0,
                        help="serve the drafter's Prometheus /metrics on this port (its --metrics-port; 0 = off)")
    parser.add_argument("--verifier-metrics-port", type=int_arg("--verifier-metrics-port", 0, 65535), default=0,
                        help="serve the verifier's Prometheus /metrics on this port (its --metrics-port; 0 = off)")
    parser.add_argument("--ready-timeout-s", type=_positive_float, default=d.ready_timeout_s,
                        help="how long to wait for every service to become healthy (model loading)")  # fmt: skip
    parser.add_argument("--log-dir", default=None, help="directory for the services' logs (default: a new temp dir)")
    parser.add_argument("--demo-prompt", default=None,
                        help="once ready, send this prompt to POST /v1/completions and print the answer with its stats")
    parser.add_argument("--demo-max-tokens",
                        type=int_arg("--demo-max-tokens", 1), default=64, help="max_tokens of the demo request")
    parser.add_argument("--exit-after-demo", action="store_true", help="stop the stack after the demo request")


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> UpConfig:
    """``UpConfig`` from parsed arguments and the environment (``REDIS_URL``)."""
    env = os.environ if environ is None else environ
    return UpConfig(
        target=args.target,
        drafter=None if args.no_drafter else args.drafter,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        drafter_port=args.drafter_port,
        verifier_port=args.verifier_port,
        device=args.device,
        drafter_device=getattr(args, "drafter_device", None) or None,
        verifier_device=getattr(args, "verifier_device", None) or None,
        drafter_cpus=tuple(getattr(args, "drafter_cpus", None) or ()),
        verifier_cpus=tuple(getattr(args, "verifier_cpus", None) or ()),
        pipeline=getattr(args, "pipeline", None) or None,
        drafter_metrics_port=getattr(args, "drafter_metrics_port", 0) or 0,
        verifier_metrics_port=getattr(args, "verifier_metrics_port", 0) or 0,
        target_dtype=args.target_dtype,
        drafter_dtype=args.drafter_dtype,
        target_revision=getattr(args, "target_revision", None) or None,
        drafter_revision=getattr(args, "drafter_revision", None) or None,
        target_file=getattr(args, "target_file", None) or None,
        drafter_file=getattr(args, "drafter_file", None) or None,
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        redis_url=env.get("REDIS_URL") or None,
        ready_timeout_s=args.ready_timeout_s,
        log_dir=args.log_dir,
    )


# -- the stack ----------------------------------------------------------------------------------


class Stack:
    """The processes of one local deployment: optional embedded Redis + the service children.

    ``start()`` launches everything (nothing waits for health yet), ``wait_ready()`` blocks until
    all are healthy, ``poll()`` reports a child that died, ``stop()`` ends everything started.
    On any failure in ``start``/``wait_ready`` the stack stops itself before raising.
    """

    def __init__(self, cfg: UpConfig, out: IO[str] | None = None):
        self.cfg = cfg  # replaced by the resolved config (ports, Redis URL) in start()
        self.out = out if out is not None else sys.stdout
        self.children: dict[str, subprocess.Popen] = {}
        self.log_paths: dict[str, Path] = {}
        self.redis: RedisServer | None = None
        self.log_dir: Path | None = None
        self._log_files: list[IO[bytes]] = []
        self._ready: set[str] = set()
        self._stopped = False

    # endpoints -----------------------------------------------------------------------------
    @property
    def rest_url(self) -> str:
        """Base URL of the gateway's REST API."""
        return f"http://{self.cfg.host}:{self.cfg.http_port}/v1"

    @property
    def grpc_target(self) -> str:
        """host:port of the gateway's gRPC API."""
        return f"{self.cfg.host}:{self.cfg.grpc_port}"

    @property
    def redis_url(self) -> str | None:
        """The Redis the gateway uses (embedded or ``$REDIS_URL``)."""
        return self.cfg.redis_url

    def endpoints(self) -> dict[str, str]:
        """Name -> address of what a client (or an operator) talks to."""
        eps = {"rest": self.rest_url, "grpc": self.grpc_target, "redis": self.cfg.redis_url or ""}
        if self.cfg.drafter is not None:
            eps["drafter"] = f"{self.cfg.host}:{self.cfg.drafter_port}"
        eps["verifier"] = f"{self.cfg.host}:{self.cfg.verifier_port}"
        return eps

    def _print(self, msg: str) -> None:
        print(msg, file=self.out, flush=True)

    # lifecycle -----------------------------------------------------------------------------
    def start(self) -> "Stack":
        """Resolve ports, start Redis if needed, launch every child. Stops everything on failure."""
        if self.children or self.redis is not None:
            raise StackError("stack already started")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        cfg = resolve_ports(self.cfg)
        self.log_dir = Path(cfg.log_dir) if cfg.log_dir else Path(tempfile.mkdtemp(prefix="crossdraft-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cfg = dataclasses.replace(cfg, log_dir=str(self.log_dir))
        checks = [("gateway REST", cfg.http_port), ("gateway gRPC", cfg.grpc_port), ("verifier", cfg.verifier_port)]
        if cfg.drafter is not None:
            checks.append(("drafter", cfg.drafter_port))
        for what, port in checks:
            if port_in_use(cfg.host, port):
                raise StackError(f"{what} port {cfg.host}:{port} is already in use (pass 0 to pick a free port)")

        if cfg.redis_url is None:
            self.redis = RedisServer(host="127.0.0.1", data_dir=self.log_dir / "redis")
            self.redis.start()
            cfg = dataclasses.replace(cfg, redis_url=self.redis.url)
            self._print(f"redis     {self.redis.url} (embedded, pid {self.redis.pid}, log {self.redis.log_path})")
        else:
            self._print(f"redis     {cfg.redis_url} (from $REDIS_URL)")
        self.cfg = cfg

        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")  # so a log's tail is current when a child dies
        for name, cmd in child_commands(cfg).items():
            log_path = self.log_dir / f"{name}.log"
            fh = open(log_path, "ab")
            self._log_files.append(fh)
            self.log_paths[name] = log_path
            self.children[name] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            self._print(f"{name:<9} pid {self.children[name].pid}, log {log_path}")

    def _probes(self) -> dict[str, Callable[[], bool]]:
        cfg = self.cfg
        probes: dict[str, Callable[[], bool]] = {}
        for name in self.children:
            if name == "gateway":
                probes[name] = HttpProbe(f"http://{cfg.host}:{cfg.http_port}/readyz")
            elif name == "drafter":
                probes[name] = GrpcHealthProbe(f"{cfg.host}:{cfg.drafter_port}")
            elif name == "verifier":
                probes[name] = GrpcHealthProbe(f"{cfg.host}:{cfg.verifier_port}")
        return probes

    def poll(self) -> tuple[str, int] | None:
        """``(name, returncode)`` of the first child (or embedded Redis) that has exited, else None."""
        for name, proc in self.children.items():
            rc = proc.poll()
            if rc is not None:
                return name, rc
        if self.redis is not None and not self.redis.running and not self._stopped:
            return "redis", -1
        return None

    def exited_error(self, name: str, rc: int, when: str = "") -> ChildExited:
        """A ``ChildExited`` for ``name`` with the tail of its log."""
        log = self.log_paths.get(name) or (self.redis.log_path if name == "redis" and self.redis else None)
        return ChildExited(name, rc, log, log_tail(log), when)

    def wait_ready(self, timeout_s: float | None = None, poll_interval_s: float = 0.2) -> None:
        """Block until every child is healthy; raise ``StackError`` (after stopping) if one exits
        or ``timeout_s`` (default ``cfg.ready_timeout_s``) passes first."""
        if not self.children:
            raise StackError("stack not started")
        timeout_s = self.cfg.ready_timeout_s if timeout_s is None else timeout_s
        probes = self._probes()
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        try:
            while True:
                dead = self.poll()
                if dead is not None:
                    raise self.exited_error(*dead, when=" before the stack was ready")
                for name, probe in probes.items():
                    if name not in self._ready and probe():
                        self._ready.add(name)
                        self._print(f"{name:<9} ready after {time.monotonic() - t0:.1f}s")
                if len(self._ready) == len(probes):
                    return
                if time.monotonic() > deadline:
                    waiting = sorted(set(probes) - self._ready)
                    parts = [f"not ready after {timeout_s:g}s: {', '.join(waiting)}"]
                    for name in waiting:
                        parts.append(f"--- {name} ({probes[name].target}), log {self.log_paths[name]}:\n"
                                     f"{log_tail(self.log_paths[name], 20)}")  # fmt: skip
                    raise StackError("\n".join(parts))
                time.sleep(poll_interval_s)
        except BaseException:
            self.stop()
            raise
        finally:
            for probe in probes.values():
                probe.close()

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM every child (gateway first), wait up to ``timeout_s``, SIGKILL what is left;
        then stop the embedded Redis. Idempotent."""
        timeout_s = self.cfg.stop_timeout_s if timeout_s is None else timeout_s
        self._stopped = True
        procs = list(self.children.items())[::-1]  # gateway first, so it stops taking requests
        for _, proc in procs:
            if proc.poll() is None:
                signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name, proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._print(f"{name} did not stop within {timeout_s:g}s: SIGKILL")
                signal_group(proc, signal.SIGKILL)
                proc.wait()
        for fh in self._log_files:
            fh.close()
        self._log_files.clear()
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# -- main ---------------------------------------------------------------------------------------


class _Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def _raise_interrupted(signum, _frame):
    raise _Interrupted(signum)


def banner(stack: Stack) -> str:
    """What `crossdraft up` prints once everything is healthy."""
    rest = stack.rest_url
    example = (
        f"curl -s {rest}/completions -H 'Content-Type: application/json' \\\n"
        f"             -d '{{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 64}}'"
    )
    mode = (f"{stack.cfg.target} + drafter {stack.cfg.drafter}" if stack.cfg.drafter
            else f"{stack.cfg.target} (no drafter)")
    lines = [
        "",
        "crossdraft is up: " + mode,
        f"  REST  {rest}",
        f"  gRPC  {stack.grpc_target}  (crossdraft.v1.GatewayService)",
        f"  Redis {stack.cfg.redis_url}",
        f"  logs  {stack.log_dir}",
        "",
        "  try:  " + example,
        "",
        "Ctrl-C to stop.",
    ]
    return "\n".join(lines)


class _DemoDone(Exception):
    pass


def demo_request(stack: Stack, prompt: str, max_tokens: int) -> bool:
    """POST one completion to the running stack and print it (the README's first request)."""
    import json

    import requests

    body = {"prompt": prompt, "max_tokens": max_tokens}
    print(f"\nPOST {stack.rest_url}/completions {json.dumps(body)}", flush=True)
    try:
        r = requests.post(f"{stack.rest_url}/completions", json=body, timeout=600)
    except requests.RequestException as e:
        print(f"demo request failed: {e}", file=sys.stderr, flush=True)
        return False
    if r.status_code != 200:
        print(f"demo request failed: HTTP {r.status_code}: {r.text}", file=sys.stderr, flush=True)
        return False
    out = r.json()
    s = out["speculative"]
    print("-" * 60 + "\n" + prompt + out["choices"][0]["text"] + "\n" + "-" * 60, flush=True)
    tok = out["usage"]["completion_tokens"]
    print(f"{tok} tokens in {s['total_ms'] / 1e3:.2f} s ({tok / max(s['total_ms'] / 1e3, 1e-9):.1f} tok/s); "
          f"{s['rounds']} rounds, drafted {s['drafted']}, accepted {s['accepted']} "
          f"({100 * s['acceptance_rate']:.0f}%), overhead {s['overhead_ms'] / max(s['rounds'], 1):.2f} ms/round",
          flush=True)
    return True


def main(args: argparse.Namespace) -> int:
    """Run the stack until Ctrl-C / SIGTERM (exit 0) or until a child dies (exit 1)."""
    cfg = config_from_args(args)
    stack = Stack(cfg)
    old = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 1
    try:
        try:
            stack.start()
            print(f"waiting for the services to become healthy (up to {cfg.ready_timeout_s:g}s) ...", flush=True)
            stack.wait_ready()
            print(banner(stack), flush=True)
            if getattr(args, "demo_prompt", None):
                ok = demo_request(stack, args.demo_prompt, args.demo_max_tokens)
                if args.exit_after_demo:
                    rc = 0 if ok else 1
                    raise _DemoDone()
            while True:
                dead = stack.poll()
                if dead is not None:
                    print(f"\n{stack.exited_error(*dead)}", file=sys.stderr, flush=True)
                    rc = 1
                    break
                time.sleep(0.5)
        except _DemoDone:
            print("stopping ...", flush=True)
        except _Interrupted as e:
            print(f"\n{e}: stopping ...", flush=True)
            rc = 0
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
            rc = 0
        except StackError as e:
            print(f"crossdraft up: {e}", file=sys.stderr, flush=True)
            rc = 1
        finally:
            # a second Ctrl-C must not cut the shutdown short
            for s in old:
                signal.signal(s, signal.SIG_IGN)
            stack.stop()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if stack.log_dir is not None:
        print(f"stopped; logs kept in {stack.log_dir}", flush=True)
    return rc
