"""Where the drafter and verifier pods are, and which one serves a session.

A :class:`Pool` holds the ready addresses of one kind of model server. Outside Kubernetes it is
static (``--verifier a:1,b:2``); inside, :class:`EndpointSliceWatcher` keeps it current from the
EndpointSlices of the kind's headless Service (official ``kubernetes`` client: list, then watch,
re-listing when the watch expires). :class:`Placement` sends a new session to the least-loaded
ready pod, keeps later rounds on the pod recorded for the session (its KV cache lives there), and
moves the session when that pod is gone -- the new pod rebuilds the cache from the history. The
connection to a pod that left its pool is closed once no call uses it (:meth:`Placement.prune`):
pods come and go with every rollout, and a gateway must not keep a channel per address it ever saw.
:func:`colocated` says whether a drafter and a verifier compute on the same hardware: one host, and
not told apart by the placement they report (CPU sets, CUDA devices); the draft-length policy prices a
colocated drafter's steps by the verification they stall.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import defaultdict

log = logging.getLogger("crossdraft.gateway.discovery")


class Pool:
    """The ready addresses ("host:port") of one kind of model server."""

    def __init__(self, kind: str, addresses=()):
        self.kind = kind
        self._lock = threading.Lock()
        self._addrs: list[str] = sorted(set(addresses))
        self.changed = threading.Condition(self._lock)
        self.version = 0

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._addrs)

    def set(self, addresses) -> None:
        new = sorted(set(addresses))
        with self._lock:
            if new != self._addrs:
                log.info("%s pool: %s", self.kind, ", ".join(new) or "(empty)")
                self._addrs = new
                self.version += 1
                self.changed.notify_all()

    def wait_nonempty(self, timeout_s: float) -> bool:
        with self._lock:
            return self.changed.wait_for(lambda: bool(self._addrs), timeout_s)


def static_pool(kind: str, spec: str | None) -> Pool | None:
    """A pool from "host:port[,host:port...]" (None or empty -> None)."""
    if not spec:
        return None
    addrs = [a.strip() for a in spec.split(",") if a.strip()]
    for a in addrs:
        host, _, port = a.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{kind}: bad address {a!r} (want host:port)")
    return Pool(kind, addrs)


def slice_addresses(obj, port_name: str = "grpc") -> list[str]:
    """Ready "ip:port" of one EndpointSlice (a kubernetes.client.V1EndpointSlice)."""
    port = None
    for p in obj.ports or []:
        if p.name == port_name or port is None:
            port = p.port
            if p.name == port_name:
                break
    if port is None:
        return []
    out = []
    for ep in obj.endpoints or []:
        cond = ep.conditions
        # Kubernetes: a nil `ready` means ready; terminating endpoints are not
        ready = cond is None or cond.ready is None or bool(cond.ready)
        terminating = cond is not None and bool(cond.terminating)
        if ready and not terminating:
            for a in ep.addresses or []:
                out.append(f"[{a}]:{port}" if ":" in a else f"{a}:{port}")
    return out


class EndpointSliceWatcher:
    """Keeps a Pool equal to the ready endpoints of a Service's EndpointSlices."""

    def __init__(self, pool: Pool, namespace: str, service: str, port_name: str = "grpc", api=None):
        self.pool = pool
        self.namespace = namespace
        self.service = service
        self.port_name = port_name
        self._api = api
        self.slices: dict[str, list[str]] = {}
        self.resource_version: str | None = None
        self._stop = threading.Event()

    @property
    def selector(self) -> str:
        return f"kubernetes.io/service-name={self.service}"

    def api(self):
        if self._api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._api = client.DiscoveryV1Api()
        return self._api

    # ---- the code path every event goes through (tests feed recorded objects here) ----
    def apply(self, event_type: str, obj) -> None:
        name = obj.metadata.name
        if event_type == "DELETED":
            self.slices.pop(name, None)
        else:  # ADDED / MODIFIED
            self.slices[name] = slice_addresses(obj, self.port_name)
        rv = getattr(obj.metadata, "resource_version", None)
        if rv:
            self.resource_version = rv
        self.pool.set(a for addrs in self.slices.values() for a in addrs)

    def relist(self) -> None:
        lst = self.api().list_namespaced_endpoint_slice(self.namespace, label_selector=self.selector)
        self.slices = {}
        for obj in lst.items:
            self.slices[obj.metadata.name] = slice_addresses(obj, self.port_name)
        self.resource_version = lst.metadata.resource_version
        self.pool.set(a for addrs in self.slices.values() for a in addrs)

    def consume(self, events) -> None:
        """Apply a stream of watch events ({"type", "object"}); ERROR events end it."""
        for ev in events:
            if self._stop.is_set():
                return
            if ev["type"] == "ERROR":
                self.resource_version = None  # e.g. 410 Gone: re-list
                return
            self.apply(ev["type"], ev["object"])

    def run(self) -> None:
        from kubernetes import watch

        backoff = 1.0
        while not self._stop.is_set():
            try:
                if self.resource_version is None:
                    self.relist()
                w = watch.Watch()
                self.consume(w.stream(self.api().list_namespaced_endpoint_slice, self.namespace,
                                      label_selector=self.selector, resource_version=self.resource_version,
                                      timeout_seconds=300))
                backoff = 1.0
            except Exception as e:  # API server unreachable, 410, ...: keep the last pool, retry
                log.warning("watch of %s/%s failed: %s; retrying in %.0fs", self.namespace, self.service, e, backoff)
                self.resource_version = None
                self._stop.wait(backoff)
                backoff = min(30.0, backoff * 2)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self.run, name=f"watch-{self.service}", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()


def first_healthy(placement, kind: str, timeout_s: float, required: bool = True):
    """A client of the first pod of `kind` that answers its health check (waits for the pool up to
    `timeout_s`, checking at least once); after that, CrossdraftError -- or None where not `required`."""
    from crossdraft.errors import CrossdraftError
    from crossdraft.serving import rpc

    deadline = time.time() + timeout_s
    pool = placement.pools[kind]
    while True:
        for addr in pool.addresses():
            if rpc.wait_healthy(addr, 1.0 if timeout_s > 0 else 0.2, tls=placement.client(kind, addr).tls):
                return placement.client(kind, addr)
        if time.time() >= deadline:
            break
        pool.wait_nonempty(min(1.0, max(0.0, deadline - time.time())))
        time.sleep(0.2)
    if not required:
        return None
    known = ", ".join(pool.addresses()) or "none known"
    raise CrossdraftError(f"no {kind} became healthy within {timeout_s} s ({known})")


class Placement:
    """Chooses drafter/verifier pods per session and keeps a client per pod."""

    # how long a pod must have been out of its pool before its client is closed (if no call is on it):
    # a request that chose the pod just before it left gets to start its calls
    gone_grace_s = 60.0

    def __init__(self, verifiers: Pool, drafters: Pool | None, make_verifier, make_drafter, more_drafters=None):
        """more_drafters: {NAME: Pool} of a pool of drafter kinds beyond the first (gateway/pool.py), kept
        under the kind "drafter:NAME" (clients made by make_drafter)."""
        self.pools = {"verifier": verifiers, "drafter": drafters}
        for name, pool in (more_drafters or {}).items():
            self.pools[f"drafter:{name}"] = pool
        self.make = {"verifier": make_verifier, "drafter": make_drafter}
        self.clients: dict[tuple[str, str], object] = {}
        self.inflight: dict[tuple[str, str], int] = defaultdict(int)
        self._gone_since: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def client(self, kind: str, addr: str):
        with self._lock:
            c = self.clients.get((kind, addr))
            if c is None:
                c = self.clients[(kind, addr)] = self.make[kind.partition(":")[0]](addr)
            return c

    def choose(self, kind: str, recorded: str | None, exclude=()) -> tuple[str | None, bool]:
        """(address, moved): the recorded pod while it is ready, else the least-loaded ready pod.
        exclude: pods not to choose (those that already refused the request); (None, ...) when no
        other ready pod is left."""
        pool = self.pools[kind]
        if pool is None:
            return None, False
        addrs = [a for a in pool.addresses() if a not in exclude]
        if not addrs:
            return None, bool(recorded)
        if recorded in addrs:
            return recorded, False
        with self._lock:
            least = min(self.inflight[(kind, a)] for a in addrs)
            best = [a for a in addrs if self.inflight[(kind, a)] == least]
        return random.choice(best), bool(recorded)

    def acquire(self, kind: str, addr: str | None) -> None:
        if addr:
            with self._lock:
                self.inflight[(kind, addr)] += 1

    def release(self, kind: str, addr: str | None) -> None:
        if addr:
            with self._lock:
                self.inflight[(kind, addr)] = max(0, self.inflight[(kind, addr)] - 1)

    def prune(self, now: float | None = None) -> list[tuple[str, str]]:
        """Close and forget the clients of pods that have been out of their pool for ``gone_grace_s``
        with no call in flight; returns their (kind, address). A pod that comes back later (same
        address) gets a new client. Sessions recorded on a gone pod move when they next run."""
        now = time.monotonic() if now is None else now
        live = {kind: set(p.addresses()) for kind, p in self.pools.items() if p is not None}
        dropped = []
        with self._lock:
            for key in list(self.clients):
                kind, addr = key
                if kind not in live or addr in live[kind]:
                    self._gone_since.pop(key, None)
                    continue
                since = self._gone_since.setdefault(key, now)
                if self.inflight.get(key, 0) > 0 or now - since < self.gone_grace_s:
                    continue
                dropped.append((key, self.clients.pop(key)))
                self._gone_since.pop(key, None)
            for key in [k for k, n in self.inflight.items() if n <= 0 and k not in self.clients]:
                del self.inflight[key]  # (choose() reads the counts of every address it sees)
        for (kind, addr), c in dropped:
            log.info("%s %s left the pool: its connection is closed", kind, addr)
            close = getattr(c, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
        return [key for key, _ in dropped]

    def info(self, kind: str, addr: str | None) -> dict | None:
        """The ModelInfo of the `kind` server at `addr` (its client's cached copy), or None when it
        cannot be asked (no address, or a server that does not answer)."""
        if not addr:
            return None
        try:
            return self.client(kind, addr).info()
        except Exception:
            return None

    def any_client(self, kind: str, timeout_s: float = 0.0):
        pool = self.pools[kind]
        if pool is None:
            return None
        t0 = time.time()
        while True:
            addrs = pool.addresses()
            if addrs:
                return self.client(kind, addrs[0])
            if time.time() - t0 >= timeout_s:
                return None
            pool.wait_nonempty(min(1.0, timeout_s))


_LOOPBACK = ("localhost", "::1", "0.0.0.0", "::")


def _host(addr: str) -> str:
    """The host part of a gRPC target (host:port, [v6]:port, dns:///host:port, ipv4:host:port)."""
    a = addr.strip()
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if a.startswith(scheme):
            a = a[len(scheme):]
    if a.startswith("["):
        return a[1:a.find("]")].lower() if "]" in a else a.lower()
    if a.count(":") == 1:
        a = a.split(":", 1)[0]
    return a.lower()


def _cuda_index(device: str) -> str:
    """A CUDA device string with its index: "cuda" is the process's current device, cuda:0."""
    return "cuda:0" if device == "cuda" else device


def _apart(v_info: dict | None, d_info: dict | None) -> bool:
    """Whether two model servers on one host compute on separate hardware, by the placement they
    report in ModelInfo: different CUDA devices, or CPU devices with disjoint CPU sets (``cpus``,
    their affinity). False when either server does not say (no info, or an older server)."""
    if not v_info or not d_info:
        return False
    dv, dd = (_cuda_index(str(i.get("device") or "").lower()) for i in (v_info, d_info))
    if dv.startswith("cuda") and dd.startswith("cuda"):
        return dv != dd
    if dv == dd == "cpu":
        cv, cd = set(v_info.get("cpus") or ()), set(d_info.get("cpus") or ())
        return bool(cv) and bool(cd) and not cv & cd
    return False


def colocated(setting: str, v_addr: str, d_addr: str | None, info=None, kind: str = "drafter") -> bool:
    """Whether the drafter at d_addr computes on the same hardware as the verifier at v_addr: "yes",
    "no", or "auto" -- both on this host's loopback, or the same host, unless the placement they
    report tells them apart (disjoint CPU sets, different CUDA devices; see ``_apart``).

    info: ``(kind, addr) -> ModelInfo dict or None`` (e.g. :meth:`Placement.info`), asked only
    for a pair on one host; without it (or without an answer) the hosts alone decide. kind: the
    drafter's placement kind ("drafter", or "drafter:NAME" in a pool of kinds)."""
    if setting in ("yes", "no"):
        return setting == "yes"
    if not d_addr:
        return False
    hv, hd = _host(v_addr), _host(d_addr)

    def local(h: str) -> bool:
        return h in _LOOPBACK or h.startswith("127.")

    same_host = (local(hv) and local(hd)) or (hv == hd and hv != "")
    if not same_host or info is None:
        return same_host
    return not _apart(info("verifier", v_addr), info(kind, d_addr))
