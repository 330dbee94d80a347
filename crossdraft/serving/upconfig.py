"""What `crossdraft up` runs, from its flags: :class:`UpConfig` (the drafter kinds, the verifier, the
gateway, their ports and placement), the drafters' names, the ports settled (:func:`resolve_ports`) and each
child's command line (:func:`child_commands`). :mod:`crossdraft.serving.up` starts and watches the children."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from crossdraft.argtypes import cpu_list_arg, format_cpu_list, int_arg, port_arg
from crossdraft.errors import InvalidArgument
from crossdraft.models.hub import is_hub_id, parse_hub_spec
from crossdraft.serving.children import port_in_use
from crossdraft.serving.redis_server import free_port

# Same defaults as `crossdraft generate` (crossdraft/cli.py); repeated here because cli.py imports
# this module.
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b"
DEFAULT_DRAFTER_PORT = 50061

# A drafter kind's name, as the gateway's --drafter-pool NAME=host:port takes it
DRAFTER_NAME_RE = re.compile(r"[a-z0-9][a-z0-9-]{0,39}")


@dataclass(frozen=True)
class DrafterKind:
    """One drafter service of the stack: its model, name, ports and placement.

    ``UpConfig`` holds the first drafter in its ``drafter*`` fields and the further ones as
    ``DrafterKind``s in ``more_drafters``; ``drafters(cfg)`` gives all of them alike.
    """

    model: str  # catalog name, HF directory, .gguf or Hub id
    name: str | None = None  # [a-z0-9][a-z0-9-]{0,39}; None = derived from the model (drafter_name_for)
    port: int | None = None  # gRPC port; 0 = a free one; None = the one after the previous drafter's (free if 0)
    metrics_port: int | None = 0  # Prometheus port; 0 = off; None = the one after the previous drafter's (off if 0)
    dtype: str | None = None  # its --dtype (None = the service's own)
    revision: str | None = None  # its --revision of a Hub id
    file: str | None = None  # its --model-file: the GGUF of a Hub repo holding several
    device: str | None = None  # its --device (None = UpConfig.device)
    cpus: tuple[int, ...] = ()  # its --cpus (() = unpinned)


@dataclass(frozen=True)
class UpConfig:
    """What `crossdraft up` runs. Ports 0 are replaced by free ones (``resolve_ports``)."""

    target: str = DEFAULT_TARGET  # target model (verifier): catalog name, HF directory or .gguf
    drafter: str | None = DEFAULT_DRAFTER  # drafter model; None = no drafter (target-only)
    host: str = "127.0.0.1"  # interface every service binds and is probed on
    http_port: int = 8000  # gateway REST port (0 = pick a free one)
    grpc_port: int = 50051  # gateway gRPC port (0 = pick a free one)
    drafter_port: int = DEFAULT_DRAFTER_PORT  # (first) drafter gRPC port (0 = pick a free one)
    verifier_port: int = 50062  # verifier gRPC port (0 = pick a free one)
    device: str | None = None  # --device for drafter and verifier (None = their default)
    drafter_device: str | None = None  # the drafter's --device, overriding `device` (None = `device`)
    verifier_device: str | None = None  # the verifier's --device, overriding `device` (None = `device`)
    drafter_cpus: tuple[int, ...] = ()  # the drafter's --cpus: pinned to these CPUs (() = unpinned)
    verifier_cpus: tuple[int, ...] = ()  # the verifier's --cpus (() = unpinned); gateway and Redis stay unpinned
    pipeline: str | None = None  # the gateway's --pipeline auto|on|off (None = the gateway's default)
    load_gate: str | None = None  # the gateway's --load-gate on|off (None = the gateway's default)
    branch: str | None = None  # the gateway's --branch on|off (None = the gateway's default)
    drafter_metrics_port: int = 0  # the drafter's Prometheus --metrics-port (0 = off)
    verifier_metrics_port: int = 0  # the verifier's Prometheus --metrics-port (0 = off)
    target_dtype: str | None = None  # verifier --dtype (None = its default)
    drafter_dtype: str | None = None  # drafter --dtype (None = its default)
    target_revision: str | None = None  # verifier --revision of a Hub-id target (None = the id's own / main)
    drafter_revision: str | None = None  # drafter --revision of a Hub-id drafter
    target_file: str | None = None  # verifier --model-file: the GGUF of a Hub-id target repo holding several
    drafter_file: str | None = None  # drafter --model-file: the GGUF of a Hub-id drafter repo holding several
    drafter_name: str | None = None  # the first drafter's name (None = derived from its model)
    more_drafters: tuple[DrafterKind, ...] = ()  # further drafter kinds, each its own service (needs `drafter`)
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


def drafter_name_for(model: str) -> str:
    """A drafter kind's name derived from its model: a catalog name itself, a Hub id's repo name, a
    path's last component (without ``.gguf``); lower-cased, every run of characters outside
    [a-z0-9-] made one '-', at most 40 characters ("drafter" when nothing is left)."""
    text = str(model).strip().rstrip("/\\")
    if is_hub_id(text):
        base = parse_hub_spec(text).repo_id.split("/")[1]
    else:
        base = re.split(r"[/\\]", text)[-1]
        if base.lower().endswith(".gguf"):
            base = base[: -len(".gguf")]
    name = re.sub(r"[^a-z0-9-]+", "-", base.lower())
    name = re.sub(r"-{2,}", "-", name).strip("-")[:40].rstrip("-")
    return name or "drafter"


def _unique_name(base: str, taken: set[str]) -> str:
    """``base``, or ``base-2``, ``base-3`` ... (cut to stay within 40 characters), whichever is not taken."""
    if base not in taken:
        return base
    k = 2
    while True:
        suffix = f"-{k}"
        name = base[: 40 - len(suffix)].rstrip("-") + suffix
        if name not in taken:
            return name
        k += 1


def _assign_names(kinds: list[tuple[str | None, str]], field: str) -> list[str]:
    """The name of each ``(explicit name or None, model)``: explicit names as given (each once, valid),
    the others derived from their models and made unique (-2, -3 ...) against every other name."""
    explicit = [n for n, _ in kinds if n is not None]
    for n in explicit:
        if not DRAFTER_NAME_RE.fullmatch(n):
            raise InvalidArgument(field, f"drafter name {n!r} must be 1-40 characters of a-z, 0-9 and '-', "
                                         "starting with a letter or digit")
    dup = sorted({n for n in explicit if explicit.count(n) > 1})
    if dup:
        raise InvalidArgument(field, f"drafter name {dup[0]!r} is given twice; each drafter needs its own name")
    taken = set(explicit)
    out = []
    for n, model in kinds:
        if n is None:
            n = _unique_name(drafter_name_for(model), taken)
            taken.add(n)
        out.append(n)
    return out


def drafters(cfg: UpConfig) -> tuple[DrafterKind, ...]:
    """Every drafter of ``cfg``, first the one in its ``drafter*`` fields, each with its name
    (``()`` without a drafter). Ports are as configured (``resolve_ports`` settles 0 and None)."""
    if cfg.drafter is None:
        if cfg.more_drafters:
            raise ValueError("more_drafters need a first drafter (cfg.drafter is None)")
        return ()
    first = DrafterKind(model=cfg.drafter, name=cfg.drafter_name, port=cfg.drafter_port,
                        metrics_port=cfg.drafter_metrics_port, dtype=cfg.drafter_dtype,
                        revision=cfg.drafter_revision, file=cfg.drafter_file, device=cfg.drafter_device,
                        cpus=cfg.drafter_cpus)  # fmt: skip
    kinds = (first, *cfg.more_drafters)
    try:
        names = _assign_names([(k.name, k.model) for k in kinds], "drafter_name")
    except InvalidArgument as e:
        raise ValueError(str(e)) from None
    return tuple(dataclasses.replace(k, name=n) for k, n in zip(kinds, names, strict=True))


def drafter_children(cfg: UpConfig) -> dict[str, DrafterKind]:
    """Child name -> drafter: ``drafter`` for a single one, ``drafter-NAME`` for each of several."""
    kinds = drafters(cfg)
    if len(kinds) == 1:
        return {"drafter": kinds[0]}
    return {f"drafter-{k.name}": k for k in kinds}


def _next_port(host: str, after: int, taken: set[int]) -> int:
    """The first port above ``after`` that the stack does not use and nothing here listens on."""
    p = after + 1
    while p in taken or port_in_use(host, p):
        p += 1
        if p > 65535:
            raise StackError(f"no free port above {after} on {host}")
    return p


def resolve_ports(cfg: UpConfig) -> UpConfig:
    """``cfg`` with every port 0 replaced by a currently free port (all distinct), and each further
    drafter's port / metrics port None by the next free one after the previous drafter's (a free
    port / off where that one's is 0)."""
    more = cfg.more_drafters
    taken: set[int] = {p for p in (cfg.http_port, cfg.grpc_port, cfg.drafter_port, cfg.verifier_port,
                                   cfg.drafter_metrics_port, cfg.verifier_metrics_port) if p}  # fmt: skip
    taken |= {p for k in more for p in (k.port, k.metrics_port) if p}

    def free() -> int:
        while (p := free_port(cfg.host)) in taken:
            pass
        taken.add(p)
        return p

    changes: dict = {}
    for name in ("drafter_port", "verifier_port", "grpc_port", "http_port"):
        if getattr(cfg, name) == 0:
            changes[name] = free()
    resolved = []
    prev_free = cfg.drafter_port == 0  # the previous drafter's port was a free one: so are its followers'
    prev = changes.get("drafter_port", cfg.drafter_port)
    prev_m = cfg.drafter_metrics_port
    for k in more:
        if k.port == 0 or (k.port is None and prev_free):
            port = free()
        elif k.port is None:
            port = _next_port(cfg.host, prev, taken)
            taken.add(port)
        else:
            port = k.port
        mport = k.metrics_port
        if mport is None:
            mport = _next_port(cfg.host, prev_m, taken) if prev_m else 0
            if mport:
                taken.add(mport)
        prev_free = k.port == 0 or (k.port is None and prev_free)
        prev, prev_m = port, mport
        resolved.append(dataclasses.replace(k, port=port, metrics_port=mport))
    if more:
        changes["more_drafters"] = tuple(resolved)
    return dataclasses.replace(cfg, **changes)


def child_commands(cfg: UpConfig) -> dict[str, list[str]]:
    """Command line of each child, in start order: the drafters (unless disabled), verifier, gateway.

    Expects resolved ports and a Redis URL (``Stack.start`` provides both). The gateway gets the
    first drafter as ``--drafter host:port`` and each further one as ``--drafter-pool NAME=host:port``.
    """
    if cfg.redis_url is None:
        raise ValueError("child_commands needs cfg.redis_url (Stack.start fills it in)")
    kids = drafter_children(cfg)
    ports: dict[str, int | None] = {"http_port": cfg.http_port, "grpc_port": cfg.grpc_port,
                                    "verifier_port": cfg.verifier_port}  # fmt: skip
    if cfg.verifier_metrics_port:
        ports["verifier_metrics_port"] = cfg.verifier_metrics_port
    for i, k in enumerate(kids.values()):
        label = "drafter" if i == 0 else f"drafter[{k.name}]"
        ports[f"{label}_port"] = k.port
        if k.metrics_port != 0:
            ports[f"{label}_metrics_port"] = k.metrics_port
    for name, port in ports.items():
        if port is None or not 0 < port < 65536:
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
    for child, k in kids.items():
        cmds[child] = [cfg.python, "-m", "drafter",
                       *model_args(k.model, k.port, k.dtype, k.revision, k.file, k.device, k.cpus,
                                   k.metrics_port)]  # fmt: skip
    cmds["verifier"] = [cfg.python, "-m", "verifier",
                        *model_args(cfg.target, cfg.verifier_port, cfg.target_dtype, cfg.target_revision,
                                   cfg.target_file, cfg.verifier_device, cfg.verifier_cpus,
                                   cfg.verifier_metrics_port)]
    gateway = [cfg.python, "-m", "gateway"]
    for i, k in enumerate(kids.values()):
        address = f"{cfg.host}:{k.port}"
        gateway += ["--drafter", address] if i == 0 else ["--drafter-pool", f"{k.name}={address}"]
        if i == 0 and len(kids) > 1:  # (the gateway names its first kind as up does)
            gateway += ["--drafter-name", k.name]
    gateway += [
        "--verifier", f"{cfg.host}:{cfg.verifier_port}",
        "--redis-url", cfg.redis_url,
        "--host", cfg.host,
        "--http-port", str(cfg.http_port),
        "--grpc-port", str(cfg.grpc_port),
    ]  # fmt: skip
    if kids:  # up starts every drafter itself: the gateway waits for them as long as up waits for the stack
        gateway += ["--drafter-start-wait-s", f"{cfg.ready_timeout_s:g}"]
    if cfg.pipeline:
        gateway += ["--pipeline", cfg.pipeline]
    if cfg.load_gate:
        gateway += ["--load-gate", cfg.load_gate]
    if cfg.branch:
        gateway += ["--branch", cfg.branch]
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


@dataclass(frozen=True)
class _ForDrafter:
    """One value of a per-drafter flag: for the drafter ``name``, or for every drafter (``name`` None)."""

    name: str | None
    value: object


# NAME=VALUE, where NAME is a drafter name: a Hub id (org/name), a path (./x, /x, x.gguf) or a catalog
# name (with '.') never matches, so a plain --drafter MODEL is never mistaken for one
_NAME_VALUE_RE = re.compile(r"([a-z0-9][a-z0-9-]{0,39})=(.*)", re.DOTALL)


def _drafter_arg(s: str) -> _ForDrafter:
    """``--drafter [NAME=]MODEL``."""
    text = str(s).strip()
    m = _NAME_VALUE_RE.fullmatch(text)
    if m is not None:
        if not m.group(2).strip():
            raise argparse.ArgumentTypeError(f"--drafter: {s!r} names drafter {m.group(1)!r} but no model "
                                             "(NAME=MODEL)")
        return _ForDrafter(m.group(1), m.group(2).strip())
    if not text:
        raise argparse.ArgumentTypeError("--drafter: must name a model (catalog name, HF directory, .gguf or Hub "
                                         "id), got ''")
    return _ForDrafter(None, text)


def _per_drafter(flag: str, parse: Callable[[str], object] = str.strip):
    """A type for per-drafter flag ``flag``: ``VALUE`` (every drafter) or ``NAME=VALUE`` (drafter NAME),
    the value checked by ``parse``."""

    def parse_one(s: str) -> _ForDrafter:
        m = _NAME_VALUE_RE.fullmatch(str(s).strip())
        if m is None:
            return _ForDrafter(None, parse(s))
        if not m.group(2).strip():
            raise argparse.ArgumentTypeError(f"{flag}: {s!r} names drafter {m.group(1)!r} but no value "
                                             "(NAME=VALUE)")
        return _ForDrafter(m.group(1), parse(m.group(2).strip()))

    return parse_one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `crossdraft up`."""
    d = UpConfig()
    each = " (every drafter; NAME=VALUE: drafter NAME only; repeatable)"
    parser.add_argument("--target", default=d.target,
                        help="target model: catalog name, HF directory, .gguf or Hub id org/name[@revision]")
    parser.add_argument("--drafter", action="append", type=_drafter_arg, default=None, metavar="[NAME=]MODEL",
                        help="drafter model: catalog name, HF directory, .gguf or Hub id org/name[@revision] "
                             f"(default {d.drafter}). Repeat for several drafter kinds, each its own service: "
                             "the first is the gateway's --drafter, the others its --drafter-pool NAME=host:port. "
                             "NAME (a-z, 0-9, '-', at most 40) defaults to the model's name")
    parser.add_argument("--target-revision", default=None, help="branch, tag or commit of a Hub-id target")
    parser.add_argument("--drafter-revision", action="append", type=_per_drafter("--drafter-revision"),
                        default=None, metavar="[NAME=]REV", help="branch, tag or commit of a Hub-id drafter" + each)
    parser.add_argument("--target-file", default=None,
                        help="the GGUF to serve of a Hub-id target repo holding several (its path in the repo; "
                             "or name its quantisation tag: org/name:Q4_K_M)")
    parser.add_argument("--drafter-file", action="append", type=_per_drafter("--drafter-file"), default=None,
                        metavar="[NAME=]FILE",
                        help="the GGUF to serve of a Hub-id drafter repo holding several (its path in the repo)"
                             + each)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let both model servers run a Hub repo's own code (off by default)")
    parser.add_argument("--no-drafter", action="store_true", help="run target-only: no drafter service")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N for both models (default: the services' own)")
    parser.add_argument("--drafter-device", action="append", type=_per_drafter("--drafter-device"), default=None,
                        metavar="[NAME=]DEVICE",
                        help="the drafter's device, overriding --device (e.g. cuda:0 beside --verifier-device "
                             "cuda:1)" + each)
    parser.add_argument("--verifier-device", default=None, help="the verifier's device, overriding --device")
    parser.add_argument("--drafter-cpus", action="append", type=_per_drafter("--drafter-cpus", cpu_list_arg(
                            "--drafter-cpus")), default=None, metavar="[NAME=]LIST",
                        help="pin the drafter to these CPUs, e.g. 0 or 0-3 or 0,2,4-5, with one torch thread each "
                             "(its --cpus; default: unpinned)" + each)
    parser.add_argument("--verifier-cpus", type=cpu_list_arg("--verifier-cpus"), default=None, metavar="LIST",
                        help="pin the verifier to these CPUs (its --cpus; default: unpinned). The gateway and "
                             "Redis stay unpinned")
    parser.add_argument("--pipeline", choices=("auto", "on", "off"), default=None,
                        help="the gateway's --pipeline: draft the next block while the verifier checks this one "
                             "(default: the gateway's own)")
    parser.add_argument("--branch", choices=("on", "off"), default=None,
                        help="the gateway's --branch: pipelined greedy rounds also draft the block after each "
                             "block's likeliest correction (default: the gateway's own)")
    parser.add_argument("--load-gate", choices=("on", "off"), default=None,
                        help="the gateway's --load-gate: hold drafting at a load where target-only rounds measure "
                             "more goodput (default: the gateway's own, on)")
    parser.add_argument("--target-dtype", default=None, help="verifier dtype (default: the service's own)")
    parser.add_argument("--drafter-dtype", action="append", type=_per_drafter("--drafter-dtype"), default=None,
                        metavar="[NAME=]DTYPE", help="drafter dtype (default: the service's own)" + each)
    parser.add_argument("--http-port", type=_port_arg, default=d.http_port, help="gateway REST port (0 = free port)")
    parser.add_argument("--grpc-port", type=_port_arg, default=d.grpc_port, help="gateway gRPC port (0 = free port)")
    parser.add_argument("--drafter-port", action="append",
                        type=_per_drafter("--drafter-port", port_arg("--drafter-port", zero="a free port")),
                        default=None, metavar="[NAME=]PORT",
                        help=f"the first drafter's gRPC port (default {d.drafter_port}; 0 = free port); each further "
                             "drafter takes the next free port after the previous one's (free ports after a 0), "
                             "or its own NAME=PORT")
    parser.add_argument("--verifier-port", type=_port_arg, default=d.verifier_port,
                        help="verifier gRPC port (0 = free port)")
    parser.add_argument("--drafter-metrics-port", action="append",
                        type=_per_drafter("--drafter-metrics-port", int_arg("--drafter-metrics-port", 0, 65535)),
                        default=None, metavar="[NAME=]PORT",
                        help="serve the drafters' Prometheus /metrics (their --metrics-port; 0 = off): the first "
                             "drafter's on this port, each further one's on the next free port after the previous "
                             "one's; NAME=PORT: drafter NAME's own (only its own: the others stay off unless a plain "
                             "value turns them on)")
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


def _given(args: argparse.Namespace, attr: str) -> list[_ForDrafter]:
    """The values of a per-drafter flag; a Namespace built by hand may hold one plain value instead."""
    v = getattr(args, attr, None)
    if v is None:
        return []
    if isinstance(v, list) and all(isinstance(x, _ForDrafter) for x in v):
        return v
    return [v if isinstance(v, _ForDrafter) else _ForDrafter(None, v)]


def _per_drafter_values(args: argparse.Namespace, attr: str, flag: str,
                        names: list[str] | None) -> tuple[object, dict[str, object]]:
    """(the value for every drafter or None, {drafter name: its own value}); the last one given wins.
    ``names`` None (no drafter): NAME=VALUE is ignored, like every per-drafter flag then."""
    plain, own = None, {}
    for x in _given(args, attr):
        if x.name is None:
            plain = x.value
        elif names is None:
            continue
        elif x.name not in names:
            raise InvalidArgument(flag, f"no drafter is named {x.name!r} (in {x.name}={x.value}); the drafters are "
                                        f"{', '.join(names)} (--drafter NAME=MODEL names one, a plain --drafter "
                                        "MODEL is named after its model)")
        else:
            own[x.name] = x.value
    return plain, own


def _check_distinct_ports(ports: list[tuple[str, str, int | None]]) -> None:
    """Every port given (not 0 or None) once; InvalidArgument naming the flag of the second use otherwise.
    ``ports``: (flag, what it is, port)."""
    seen: dict[int, tuple[str, str]] = {}
    for flag, what, port in ports:
        if not port:
            continue
        if port in seen:
            raise InvalidArgument(flag, f"port {port} ({what}) is already the {seen[port][1]}'s ({seen[port][0]}); "
                                        "each service needs its own port (0 = a free one)")
        seen[port] = (flag, what)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> UpConfig:
    """``UpConfig`` from parsed arguments and the environment (``REDIS_URL``).

    InvalidArgument (naming the flag) for NAME=VALUE naming no drafter, a drafter name given twice,
    or a port given to two services."""
    env = os.environ if environ is None else environ
    given = [] if getattr(args, "no_drafter", False) else _given(args, "drafter")
    if not given and not getattr(args, "no_drafter", False):
        given = [_ForDrafter(None, DEFAULT_DRAFTER)]
    names = _assign_names([(x.name, str(x.value)) for x in given], "--drafter") if given else None
    flags = {attr: _per_drafter_values(args, attr, "--" + attr.replace("_", "-"), names)
             for attr in ("drafter_dtype", "drafter_revision", "drafter_file", "drafter_device", "drafter_cpus",
                          "drafter_port", "drafter_metrics_port")}  # fmt: skip

    def kind(i: int, name: str | None) -> DrafterKind:
        def value(attr):
            plain, own = flags[attr]
            return own.get(name, plain) if name is not None else plain

        # a further drafter without its own ports: the port after the previous drafter's; metrics on
        # such ports only where a plain --drafter-metrics-port turned them on for every drafter
        port = flags["drafter_port"][1].get(name)
        metrics = flags["drafter_metrics_port"][1].get(name, None if flags["drafter_metrics_port"][0] else 0)
        if i == 0:
            port = value("drafter_port")
            port = DEFAULT_DRAFTER_PORT if port is None else port
            metrics = value("drafter_metrics_port") or 0
        return DrafterKind(model=str(given[i].value) if given else DEFAULT_DRAFTER, name=name, port=port,
                           metrics_port=metrics, dtype=value("drafter_dtype") or None,
                           revision=value("drafter_revision") or None, file=value("drafter_file") or None,
                           device=value("drafter_device") or None, cpus=tuple(value("drafter_cpus") or ()))

    kinds = [kind(i, n) for i, n in enumerate(names)] if names else [kind(0, None)]
    first = kinds[0]
    ports = [("--http-port", "gateway REST", args.http_port), ("--grpc-port", "gateway gRPC", args.grpc_port),
             ("--verifier-port", "verifier", args.verifier_port),
             ("--verifier-metrics-port", "verifier metrics", getattr(args, "verifier_metrics_port", 0))]
    for k in kinds if names else []:
        ports += [("--drafter-port", f"drafter {k.name}", k.port),
                  ("--drafter-metrics-port", f"drafter {k.name} metrics", k.metrics_port)]
    _check_distinct_ports(ports)
    return UpConfig(
        target=args.target,
        drafter=str(given[0].value) if given else None,
        drafter_name=names[0] if names and (given[0].name is not None or len(names) > 1) else None,
        more_drafters=tuple(kinds[1:]),
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        drafter_port=first.port,
        verifier_port=args.verifier_port,
        device=args.device,
        drafter_device=first.device,
        verifier_device=getattr(args, "verifier_device", None) or None,
        drafter_cpus=first.cpus,
        verifier_cpus=tuple(getattr(args, "verifier_cpus", None) or ()),
        pipeline=getattr(args, "pipeline", None) or None,
        load_gate=getattr(args, "load_gate", None) or None,
        branch=getattr(args, "branch", None) or None,
        drafter_metrics_port=first.metrics_port,
        verifier_metrics_port=getattr(args, "verifier_metrics_port", 0) or 0,
        target_dtype=args.target_dtype,
        drafter_dtype=first.dtype,
        target_revision=getattr(args, "target_revision", None) or None,
        drafter_revision=first.revision,
        target_file=getattr(args, "target_file", None) or None,
        drafter_file=first.file,
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        redis_url=env.get("REDIS_URL") or None,
        ready_timeout_s=args.ready_timeout_s,
        log_dir=args.log_dir,
    )
