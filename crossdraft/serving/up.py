"""`crossdraft up`: the whole stack on one machine, with one command.

Starts (with this Python interpreter) one drafter service per drafter kind (``--drafter`` is
repeatable), a verifier service and the gateway, plus an embedded Redis when ``$REDIS_URL`` is
unset; waits until every part reports healthy (gRPC health ``Check("")`` = SERVING for drafters
and verifier, ``GET /readyz`` = 200 for the gateway), prints the endpoints, and runs until Ctrl-C /
SIGTERM or until a child dies. Then it stops everything it started: SIGTERM, a grace period,
SIGKILL; Redis last.

Several drafters: the first is the gateway's ``--drafter``, each further one a ``--drafter-pool
NAME=host:port``. Every drafter has a name (``--drafter NAME=MODEL``, or derived from its model),
its own port and metrics port; the per-drafter flags (``--drafter-dtype`` ...) apply to every
drafter, or to one as ``NAME=VALUE``.

Children run in their own sessions (process groups), so a terminal's Ctrl-C reaches only this
supervisor, which then shuts them down in order; signals go to the whole group, so anything a
child spawned goes with it. Child output goes to ``<log-dir>/<name>.log`` (``drafter.log`` for a
single drafter, ``drafter-NAME.log`` for each of several).

The CLI wiring is ``add_arguments(parser)`` + ``main(args)``; the testable parts are
``UpConfig`` (what to run), ``drafters(cfg)`` (every drafter kind, named), ``child_commands(cfg)``
(the exact command lines) and ``Stack`` (start / wait_ready / poll / stop).
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
from pathlib import Path
from typing import IO, Callable

from crossdraft.serving.children import GrpcHealthProbe, HttpProbe, log_tail, port_in_use, signal_group
from crossdraft.serving.redis_server import RedisServer
from crossdraft.serving.upconfig import (  # noqa: F401 -- (re-exported: the CLI, tests and benchmarks import them here)
    DEFAULT_DRAFTER,
    DEFAULT_DRAFTER_PORT,
    DEFAULT_TARGET,
    DRAFTER_NAME_RE,
    ChildExited,
    DrafterKind,
    StackError,
    UpConfig,
    add_arguments,
    child_commands,
    config_from_args,
    drafter_children,
    drafter_name_for,
    drafters,
    resolve_ports,
)

__all__ = [
    "DRAFTER_NAME_RE",
    "ChildExited",
    "DrafterKind",
    "Stack",
    "StackError",
    "UpConfig",
    "add_arguments",
    "child_commands",
    "config_from_args",
    "drafter_children",
    "drafter_name_for",
    "drafters",
    "main",
    "resolve_ports",
]

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
        for child, k in drafter_children(self.cfg).items():  # drafter, or drafter-NAME for each of several
            eps[child] = f"{self.cfg.host}:{k.port}"
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
        checks += [(child, k.port) for child, k in drafter_children(cfg).items()]
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
        kids = drafter_children(cfg)
        for name in self.children:
            if name == "gateway":
                probes[name] = HttpProbe(f"http://{cfg.host}:{cfg.http_port}/readyz")
            elif name in kids:
                probes[name] = GrpcHealthProbe(f"{cfg.host}:{kids[name].port}")
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
    kinds = drafters(stack.cfg)
    if len(kinds) > 1:
        mode = f"{stack.cfg.target} + drafters " + ", ".join(k.name or "" for k in kinds)
    else:
        mode = (f"{stack.cfg.target} + drafter {stack.cfg.drafter}" if stack.cfg.drafter
                else f"{stack.cfg.target} (no drafter)")
    lines = [
        "",
        "crossdraft is up: " + mode,
        f"  REST  {rest}",
        f"  gRPC  {stack.grpc_target}  (crossdraft.v1.GatewayService)",
        f"  Redis {stack.cfg.redis_url}",
    ]
    if len(kinds) > 1:  # the gateway's --drafter, then its --drafter-pool kinds
        lines += [f"  drafter {k.name}  {stack.cfg.host}:{k.port}  ({k.model})" for k in kinds]
    lines += [
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
