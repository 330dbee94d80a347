"""The gateway's core, shared by its REST and gRPC front ends: :class:`Gateway` pairs the target
and drafter models, keeps one Decoder per (verifier, drafter) replica pair, answers readiness,
manages sessions and starts requests (:class:`gateway.job.Job` runs them)."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time

from opentelemetry import trace

from crossdraft.decoding.decode import Decoder
from crossdraft.decoding.gate import LoadGate
from crossdraft.decoding.output import check_stop
from crossdraft.decoding.pipeline import pipeline_on
from crossdraft.errors import NotFound, Unavailable, check_int, check_session_id
from crossdraft.vocab.pair import TokenPair

from .admission import Admission
from .config import GatewayConfig
from .discovery import colocated
from .job import Job
from .metrics import Metrics
from .pool import DrafterKind, PoolPriors, kind_name
from .sessions import RedisSessionStore, Session, server_session_id
from .validation import check_input, validate_options

log = logging.getLogger("crossdraft.gateway")


class Gateway:
    """placement: a :class:`gateway.discovery.Placement` over the verifier and drafter pools."""

    def __init__(self, cfg: GatewayConfig, pair: TokenPair, placement, store: RedisSessionStore, *,
                 tracer=None, metrics: Metrics | None = None, eos_ids=(), max_context: int = 0, kinds=None,
                 kind_keys=None):
        """pair: the target paired with the first drafter kind (or alone); kinds: the pool of drafter
        kinds paired so far (gateway/pool.py DrafterKind, the first one's pair being `pair`); None: the one
        drafter of placement's "drafter" pool, if any. kind_keys: the placement keys of every configured
        kind, in the operator's order (those not in `kinds` are paired later: :meth:`pair_later`)."""
        self.cfg = cfg
        self.pair = pair
        self.placement = placement
        self.store = store
        self.tracer = tracer or trace.get_tracer("crossdraft.gateway")
        self.metrics = metrics or Metrics()
        self.eos_ids = tuple(eos_ids)
        self.max_context = max_context
        self.admission = Admission(cfg.max_concurrent_requests, cfg.max_queued_requests, cfg.queue_timeout_s)
        self.metrics.queued.set_function(lambda: self.admission.waiting)
        self._decoders: dict[tuple, Decoder] = {}
        # one load gate per verifier replica (crossdraft.decoding.gate), shared by its Decoders (one per
        # drafter replica and kind): whether drafting pays is a question of the verifier's whole load
        self._gates: dict[str, LoadGate] = {}
        self.metrics.watch_gates(lambda: dict(self._gates))
        self._lock = threading.Lock()  # the decoders and gates (held over no remote call)
        self._making: dict[tuple, threading.Lock] = {}  # pairs whose first Decoder is being built: one builder each
        # the latest readiness check, (checked, ok, details, stale_since), stale_since = since which
        # check every verifier has served another revision (None: not so). readiness() builds a new
        # tuple and publishes it with one assignment; readers take the reference without a lock, so
        # the liveness probe (stale_pairing) never waits on a readiness check's remote calls. _publish
        # orders the publications and is held over no remote call.
        self._ready_cache: tuple | None = None
        self._publish = threading.Lock()
        self.draining = False  # SIGTERM: not ready, no new generations; in-flight ones finish
        v = placement.any_client("verifier")
        self.model_name = v.info().get("model_name", "target") if v is not None else "target"
        # the Hub commit each model is paired at ("" = catalog model or local path); see revision_conflict
        self.model_revision = (v.info().get("revision") or "") if v is not None else ""
        self.drafter_model, self.drafter_revision = None, ""
        if kinds is None:
            d = placement.any_client("drafter") if pair.drafter_tok is not None else None
            if d is not None and placement.pools["drafter"] is not None:
                self.drafter_model, self.drafter_revision = d.info().get("model_name"), d.info().get("revision") or ""
                kinds = [DrafterKind(kind_name(self.drafter_model or "drafter"), "drafter", pair,
                                     self.drafter_model or "", self.drafter_revision)]
        kinds = list(kinds or ())
        # the placement keys of every configured kind, in the operator's order; those not paired yet (their
        # replicas did not answer at start) wait in `pending` with why ({key: reason}), paired by pair_later
        self.kind_keys = list(kind_keys) if kind_keys is not None else [k.key for k in kinds]
        self.pending: dict[str, str] = {}
        self.watchers: list = []  # kubernetes discovery's EndpointSlice watches (gateway.server.build_gateway)
        self.kinds: dict[str, DrafterKind] = {}
        # what each kind was worth for each class of prompt (new sessions start there), shared in Redis by every
        # gateway replica of this target
        self.pool_priors = PoolPriors(getattr(store, "r", None),
                                      f"{getattr(store, 'prefix', 'crossdraft:')}pool-priors:{self.model_name}")
        self._by_key: dict[str, DrafterKind] = {}
        self.has_drafter = False
        for k in kinds:
            self.add_kind(k)

    def add_kind(self, kind: DrafterKind) -> None:
        """Pair one more drafter kind: requests that start from now on may draft with it. The kinds stay
        in the operator's order (the pool's prior tries the first fluent one first)."""
        with self._lock:
            kinds = dict(self.kinds)
            kinds[kind.name] = kind
            rank = {key: i for i, key in enumerate(self.kind_keys)}
            ordered = dict(sorted(kinds.items(), key=lambda kv: rank.get(kv[1].key, len(rank))))
            # published whole, one assignment each: a request starting now reads one consistent set
            self._by_key = {k.key: k for k in ordered.values()}
            self.kinds = ordered
            self.pending = {key: why for key, why in self.pending.items() if key != kind.key}
            self.has_drafter = True
            if self.first_kind() is kind:  # the gateway's drafter
                self.drafter_model, self.drafter_revision = kind.model, kind.revision

    def pair_later(self, keys, pair_one, interval_s: float = 2.0) -> threading.Thread | None:
        """Pair the drafter kinds of placement `keys` that were not up at start, each as soon as one of its
        replicas answers: ``pair_one(key)`` -> its DrafterKind, or None while none answers (a failure is
        logged and retried, backing off to a minute). Until then requests draft with the other kinds, or run
        target-only; readiness() lists the kinds still pending. Returns the pairing thread (None: none)."""
        keys = [k for k in keys if k not in self._by_key]
        if not keys:
            return None
        with self._lock:
            self.pending = {**self.pending, **{k: "no replica answered yet" for k in keys}}
        for key in keys:
            log.warning("drafter kind %s: no replica answered at start; the gateway pairs it once one does "
                        "(meanwhile requests draft with the other kinds, or run target-only)", key)

        def run():
            wait = dict.fromkeys(keys, interval_s)
            due = dict.fromkeys(keys, 0.0)
            while self.pending and not self.draining:
                for key in list(self.pending):
                    if time.monotonic() < due[key]:
                        continue
                    try:
                        kind = pair_one(key)
                    except Exception as e:  # e.g. its tokenizer could not be fetched: retried, later and later
                        wait[key] = min(60.0, 2 * wait[key])
                        with self._lock:
                            self.pending = {**self.pending, key: f"{type(e).__name__}: {e}"}
                        log.warning("drafter kind %s could not be paired (again in %.0f s): %s: %s", key, wait[key],
                                    type(e).__name__, e)
                        kind = None
                    if kind is not None:
                        self.add_kind(kind)
                        log.info("drafter kind %s (%s) paired", kind.name, kind.model)
                    due[key] = time.monotonic() + wait[key]
                time.sleep(interval_s / 4)

        t = threading.Thread(target=run, name="crossdraft-pairing", daemon=True)
        t.start()
        return t

    def first_kind(self) -> DrafterKind | None:
        """The gateway's first configured drafter kind (its `--drafter`; a session without a stored kind
        drafted with it), None while it is not paired."""
        return self.kind_of(self.kind_keys[0]) if self.kind_keys else None

    def kind(self, name: str | None) -> DrafterKind | None:
        """The drafter kind of that name (None: none of that name, or None asked)."""
        return self.kinds.get(name) if name else None

    def kind_of(self, key: str) -> DrafterKind | None:
        """The drafter kind of a placement key ("drafter" or "drafter:NAME")."""
        return self._by_key.get(key)

    def revision_conflict(self, kind: str, addr: str, refresh: bool = False) -> str | None:
        """Why the `kind` replica at `addr` may not be paired, or None: it serves the model this gateway
        pairs, by name, at another revision (other weights, maybe another tokenizer or EOS ids)."""
        if kind == "verifier":
            name, rev = self.model_name, self.model_revision
        else:
            k = self.kind_of(kind)
            name, rev = (k.model, k.revision) if k is not None else (self.drafter_model, self.drafter_revision)
        client = self.placement.client(kind, addr)
        info = client.info(refresh=True) if refresh else client.info()
        other = info.get("revision") or ""
        if info.get("model_name") != name or other == rev:
            return None
        return (f"{kind} {addr} serves {name} at revision {other or '(none)'} but this gateway pairs it at revision "
                f"{rev or '(none)'}: replicas of one model must serve one revision (pin the revision, finish the "
                "rollout, then restart the gateway)")

    def supports(self, kind: str, addr: str, feature: str) -> bool:
        """Whether the `kind` replica at `addr` names `feature` in its ModelInfo.features (False when
        it cannot be asked: an older server, or one that is down)."""
        try:
            return feature in (self.placement.client(kind, addr).info().get("features") or ())
        except Exception:
            return False

    def decoder(self, v_addr: str, d_addr: str | None, kind: str = "drafter") -> Decoder:
        """One Decoder per (verifier pod, drafter pod): it remembers which masks that drafter has.
        kind: the drafter's placement kind ("drafter:NAME" for a pool's later kinds), whose pairing
        with the target the Decoder speaks.

        A pair's first Decoder asks its servers for their info (remote calls, as slow as the server is):
        that happens outside the gateway's lock, so requests to other replicas never wait on a slow one;
        one thread builds each pair's Decoder, the others asking for it meanwhile wait for that one."""
        key = (v_addr, d_addr, kind if d_addr else "")
        with self._lock:
            dec = self._decoders.get(key)
            if dec is not None:
                return dec
            making = self._making.setdefault(key, threading.Lock())
        try:
            with making:
                with self._lock:
                    dec = self._decoders.get(key)
                if dec is None:
                    built = self._new_decoder(v_addr, d_addr, kind)
                    with self._lock:
                        dec = self._decoders.setdefault(key, built)
                return dec
        finally:
            with self._lock:  # (after a failed build, each waiter tries again)
                if self._making.get(key) is making:
                    del self._making[key]

    def _new_decoder(self, v_addr: str, d_addr: str | None, kind: str) -> Decoder:
        why = self.revision_conflict("verifier", v_addr)
        if why:
            raise Unavailable(why)
        v = self.placement.client("verifier", v_addr)
        d = self.placement.client(kind, d_addr) if d_addr else None
        k = self.kind_of(kind) if d_addr else None
        co = colocated(self.cfg.colocated, v_addr, d_addr, self.placement.info, kind)
        with self._lock:
            gate = self._gates.setdefault(v_addr, LoadGate(enabled=self.cfg.load_gate != "off"))
        return Decoder(k.pair if k is not None else self.pair, v, d, eos_ids=self.eos_ids,
                       max_context=self.max_context, check_context=True, drafter_timeout_s=self.cfg.drafter_timeout_s,
                       round_log=self.cfg.round_log, colocated=co, pipeline=pipeline_on(self.cfg.pipeline, co),
                       name=k.name if k is not None else "", gate=gate, branch=self.cfg.branch == "on")

    # ---- readiness ---------------------------------------------------------------------------
    def readiness(self, max_age_s: float = 1.0) -> tuple[bool, dict]:
        """(ready, details): Redis answers and every verifier this gateway routes to reports SERVING
        on its gRPC health service (its model is loaded), not merely a connection that opens.
        Drafters are reported but do not gate readiness: without one the gateway serves
        target-only. Cached for ``max_age_s`` (probes and /readyz stay cheap)."""
        if self.draining:
            return False, {"draining": True}
        now = time.monotonic()
        cached = self._ready_cache  # (published whole: no lock)
        if cached is not None and now - cached[0] < max_age_s:
            return cached[1], cached[2]
        details: dict = {"redis": "ok" if self.store.ping() else "unreachable"}
        ok = details["redis"] == "ok"
        for kind, pool in self.placement.pools.items():
            if pool is None:
                continue
            states = {addr: self._health(kind, addr) for addr in pool.addresses()}
            for addr, st in states.items():  # a replica of another revision is refused, like one that is down
                why = None
                with contextlib.suppress(Exception):  # a probe answers, never raises
                    why = self.revision_conflict(kind, addr, refresh=True) if st == "SERVING" else None
                if why:
                    states[addr] = f"REFUSED ({why})"
            if kind == "drafter" or kind.startswith("drafter:"):  # every kind's replicas (addresses are distinct)
                details.setdefault("drafters", {}).update(states)
            else:
                details[kind + "s"] = states
            if kind == "verifier" and (not states or any(s != "SERVING" for s in states.values())):
                ok = False
        if self.pending:  # kinds not paired yet (none of their replicas answered): requests draft without them
            details["pending_drafter_kinds"] = dict(self.pending)
        states = details.get("verifiers") or {}
        stale = bool(states) and all(s.startswith("REFUSED") for s in states.values())
        with self._publish:  # prev is read here: a check published meanwhile may have started the stale spell
            prev = self._ready_cache
            checked = time.monotonic()
            since = (prev[3] if prev is not None and prev[3] is not None else checked) if stale else None
            self._ready_cache = (checked, ok, details, since)
        self.forget_gone_pods()  # (the readiness probe runs this every few seconds)
        return ok, details

    def forget_gone_pods(self) -> list[tuple[str, str]]:
        """Close the connections to pods that left their pool (Placement.prune) and drop the decoders
        paired with them; returns the (kind, address) forgotten."""
        gone = set(self.placement.prune())
        if gone:
            with self._lock:
                for key in [k for k in self._decoders
                            if ("verifier", k[0]) in gone or (k[1] is not None and (k[2], k[1]) in gone)]:
                    del self._decoders[key]
                for addr in [a for a in self._gates if ("verifier", a) in gone]:
                    del self._gates[addr]
        return sorted(gone)

    def stale_pairing(self) -> str | None:
        """Why this gateway should be restarted, or None: for `stale_pairing_restart_s` every verifier
        replica has answered SERVING the paired model at another revision than the one this gateway
        paired (a revision rollout finished after it started). A restart pairs the new revision; no
        request could be served until then. Any replica at the paired revision, down or draining,
        or a model of another name, is not stale: those are the readiness probe's business.

        It reads what the latest readiness check published (the readiness probe runs one every few
        seconds), takes no lock and calls no model server itself: the liveness probe that asks must
        never wait on, or fail because of, a slow verifier -- nor on a decoder() that waits on one."""
        limit = self.cfg.stale_pairing_restart_s
        cached = self._ready_cache  # (published whole by readiness(): no lock)
        if not limit > 0 or cached is None or cached[3] is None:
            return None
        checked, details, since = cached[0], cached[2], cached[3]
        if checked - since < limit:
            return None
        refused = [s for s in details["verifiers"].values() if s.startswith("REFUSED")]
        return (f"every verifier has served another revision for {checked - since:.0f} s: "
                f"{refused[0][len('REFUSED ('):-1]}")

    def _health(self, kind: str, addr: str) -> str:
        """A model server's gRPC health status ("SERVING", "NOT_SERVING", or why it did not answer)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            stub = health_pb2_grpc.HealthStub(self.placement.client(kind, addr).channel)
            r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
        except grpc.RpcError as e:
            return f"unreachable ({e.code().name})"
        except Exception as e:  # noqa: BLE001 - a probe answers, never raises
            return f"unreachable ({type(e).__name__})"

    def end_on_servers(self, sid: str, v_addr: str | None, d_addr: str | None, d_kind: str = "drafter") -> None:
        """Drop session `sid` on the verifier and the drafter (of placement kind `d_kind`), best effort."""
        for kind, addr in (("verifier", v_addr), (d_kind, d_addr)):
            if addr:
                with contextlib.suppress(Exception):
                    self.placement.client(kind, addr).end(sid)

    # ---- sessions ----------------------------------------------------------------------------
    def create_session(self, options: dict, session_id: str | None = None, names=None, owner: str = "") -> Session:
        """owner: :func:`key_owner` of the caller's API key ("" with keys off)."""
        opts = validate_options(options, self.cfg, names)
        opts.setdefault("seed", random.getrandbits(62))
        return self.store.create(opts, session_id, owner)

    def get_session(self, sid: str, owner: str = "") -> Session:
        return self.store.get(sid, owner)

    def delete_session(self, sid: str, owner: str = "") -> bool:
        check_session_id(sid)  # a malformed id is INVALID_ARGUMENT, not "no such session"
        s = None
        with contextlib.suppress(NotFound):
            s = self.store.get(sid, owner)
        if s is None:
            return False  # none, or another key's (which stays)
        existed = self.store.delete(s)
        k = self.kind(s.drafter_kind) if s.drafter_kind else self.first_kind()
        self.end_on_servers(server_session_id(s.session_id, s.owner), s.verifier_address, s.drafter_address,
                            k.key if k is not None else "drafter")
        return existed

    # ---- generation --------------------------------------------------------------------------
    def share_prefill(self, jobs: list[Job]) -> int:
        """n completions of one prompt compute its keys and values once: the first job's sessions
        are synced with the prompt and prefilled on both model servers, and every other job's
        sessions are forked from them (shared pool blocks). The runs then find their prompt cached
        when they sync. Best effort: on any failure the runs compute their own prefill (slower,
        never different). Returns the sessions forked."""
        base = jobs[0] if jobs else None
        if base is None or len(jobs) < 2 or base.session is not None:
            return 0
        forked = 0
        try:
            v = self.placement.client("verifier", base.v_addr)
            v.sync(base.sid, base.t_ids, prefill=True)
            for j in jobs[1:]:
                if j.v_addr == base.v_addr and j.t_ids == base.t_ids:
                    v.fork(base.sid, j.sid)
                    forked += 1
            if base.use_drafter and base.d_addr and base.d_ids:
                d = self.placement.client(base.d_key, base.d_addr)
                d.sync(base.sid, base.d_ids, prefill=True)
                for j in jobs[1:]:
                    if j.use_drafter and j.d_key == base.d_key and j.d_addr == base.d_addr and j.d_ids == base.d_ids:
                        d.fork(base.sid, j.sid)
                        forked += 1
        except Exception as e:  # the runs sync by themselves
            log.warning("shared prefill of %d completions failed (each computes its own): %s", len(jobs), e)
        self.metrics.forks.inc(forked)
        return forked

    def precheck(self, *, session_id: str | None, prompt: str | None, messages: list | None, options: dict,
                 names: dict | None = None, stop=None, top_logprobs: int = -1) -> None:
        """The checks of a request that need no model server, no session and no tokenizer, run
        before it takes an admission slot: a malformed request gets its 400 / INVALID_ARGUMENT even
        while the gateway is full (not a 429 that would send the client to retry the same mistake).
        What needs the session (its kind) or the tokens (a prompt past the context) is checked once
        the request is admitted. `prompt`: the request's prompt (None for a chat request)."""
        names = names or {}
        if session_id:
            check_session_id(session_id)
        validate_options(options, self.cfg, names)
        check_stop(stop)
        check_int(names.get("top_logprobs", "top_logprobs"), top_logprobs, -1, 20)
        check_input(self.cfg, prompt, messages, names, session=bool(session_id))

    def start(self, *, session_id: str | None, prompt: str | None, messages: list | None, options: dict,
              api: str = "grpc", names: dict | None = None, stop=None, admitted: bool = False,
              owner: str = "", top_logprobs: int = -1, like: Job | None = None) -> Job:
        """Validate and prepare a request (errors raise here, before any output).

        like: another job of the same request (n completions): this one goes to the same model
        servers, so that :meth:`share_prefill` can fork its sessions from that job's.

        admitted: the caller holds an admission slot (:attr:`admission`); the job gives it back
        when it ends -- or start() does, if it raises."""
        try:
            if self.draining:
                raise Unavailable("the gateway is shutting down; retry on another replica")
            job = self._start(session_id, prompt, messages, options, api, names, stop, owner, top_logprobs, like)
        except BaseException:
            if admitted:
                self.admission.leave()
            raise
        job.admitted = admitted
        return job

    def _start(self, session_id, prompt, messages, options, api, names, stop, owner, top_logprobs, like) -> Job:
        names = names or {}
        if session_id:
            check_session_id(session_id)
        messages = check_input(self.cfg, prompt, messages, names, session=bool(session_id))
        opts = validate_options(options, self.cfg, names)
        stop = check_stop(stop)
        top_logprobs = check_int(names.get("top_logprobs", "top_logprobs"), top_logprobs, -1, 20)
        session = None
        lease = None
        if session_id:
            session = self.store.get(session_id, owner)
            lease = self.store.acquire(session)
        try:
            return Job(self, session, lease, prompt, messages, opts, api, names, stop, top_logprobs, like)
        except BaseException:
            if lease:
                self.store.release(session, lease)
            raise


__all__ = ["Gateway"]
