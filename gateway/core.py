"""The gateway's core, shared by its REST and gRPC front ends: request validation, sessions,
the round loop over the remote drafter/verifier, metrics, and one span per verification round."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from crossdraft.decoding.decode import Decoder, check_stop
from crossdraft.decoding.policy import DEFAULT_DRAFT_VOCAB, DraftConfig
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    check_int,
    check_number,
    check_session_id,
)
from crossdraft.serving.tls import TLSConfig
from crossdraft.vocab.mapping import TokenPair

from .sessions import RedisSessionStore, Session, server_session_id

log = logging.getLogger("crossdraft.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    """Configuration of the gateway (flags override CROSSDRAFT_* env vars)."""

    verifier: str | None  # verifier address(es) host:port[,host:port] (static discovery)
    redis_url: str  # Redis URL for sessions
    drafter: str | None = None  # drafter address(es) (None = target-only, unless discovered)
    discovery: str = "static"  # "static" (the addresses above) | "kubernetes" (watch EndpointSlices)
    verifier_service: str | None = None  # kubernetes: headless Service of the verifier pods
    drafter_service: str | None = None  # kubernetes: headless Service of the drafter pods (None = no drafter)
    namespace: str = "default"  # kubernetes: namespace of those Services
    port_name: str = "grpc"  # kubernetes: name of the gRPC port in the EndpointSlices
    host: str = "0.0.0.0"  # bind address
    http_port: int = 8000  # REST port (0 = pick a free one)
    grpc_port: int = 50051  # gRPC port (0 = pick a free one)
    target_tokenizer: str | None = None  # tokenizer of the target (default: the verifier's model name)
    drafter_tokenizer: str | None = None  # tokenizer of the drafter (default: the drafter's model name)
    session_ttl_s: float = 3600.0  # sessions expire after this long unused
    drafter_timeout_s: float = 10.0  # deadline of one Draft call; past it the request goes on target-only
    round_log: str | None = None  # a file: one JSON line per round appended (the cost model's view; tracing)
    # whether a drafter computes on its verifier's hardware (its steps then stall every session's
    # verification; the draft-length policy prices a lone drafter under load by that): "auto" = both
    # addresses on this host's loopback or the same host, "yes", "no"
    colocated: str = "auto"
    # the drafter drafts from its this many most frequent tokens only (vocab.TokenPair); 0 = every token
    draft_vocab: int = DEFAULT_DRAFT_VOCAB
    verifier_timeout_s: float = 120.0  # deadline of one Verify call
    max_new_tokens_limit: int = 4096  # largest max_new_tokens accepted
    default_max_new_tokens: int = 64  # when a request gives none
    default_temperature: float = 0.0  # when a request gives none (0 = greedy)
    max_prompt_chars: int = 200_000  # longer prompts are rejected (HTTP 413 / INVALID_ARGUMENT)
    connect_timeout_s: float = 900.0  # wait this long at start for drafter/verifier to become healthy
    default_num_draft_tokens: int = 4  # initial block size
    # if non-empty, /v1/* and the gRPC API need "Authorization: Bearer <key>" (env CROSSDRAFT_API_KEYS only)
    api_keys: frozenset = frozenset()
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may take to finish
    # every verifier serving the paired model at another revision this long (a rollout finished after
    # this gateway paired the old one): /healthz turns 503 so that the orchestrator restarts the
    # gateway, which then pairs the new revision. 0 = never
    stale_pairing_restart_s: float = 60.0
    max_concurrent_requests: int = 256  # generations running at once; more wait in the queue
    max_queued_requests: int = 256  # generations waiting for a slot; more are refused (429 / RESOURCE_EXHAUSTED)
    queue_timeout_s: float = 30.0  # a queued generation that gets no slot in this long is refused
    tls: TLSConfig = TLSConfig()  # public side: certificate + key -> HTTPS and gRPC over TLS
    # to the model servers: their CA (turns TLS on), the gateway's client certificate, the expected name
    upstream_tls: TLSConfig = TLSConfig(prefix="upstream_tls")
    redis_password: str = field(default="", repr=False)  # Redis AUTH (--redis-password-file or env), never shown
    redis_tls_ca_file: str = ""  # CA of a rediss:// server's certificate (default: system roots)


OPTION_FIELDS = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                 "num_draft_tokens", "adaptive_draft", "use_drafter")


_int = check_int
_num = check_number


def _bool(name, v):
    if not isinstance(v, bool):
        raise InvalidArgument(name, f"must be a boolean, got {type(v).__name__}")
    return v


def validate_options(opts: dict, cfg: GatewayConfig, names: dict | None = None) -> dict:
    """Check generation options (None = unset); `names` maps option names to the caller's field names."""
    names = names or {}
    out = {}
    for key, v in opts.items():
        if v is None:
            continue
        name = names.get(key, key)
        if key not in OPTION_FIELDS:
            raise InvalidArgument(name, "unknown option")
        if key == "max_new_tokens":
            out[key] = _int(name, v, 1, cfg.max_new_tokens_limit)
        elif key in ("temperature", "top_p", "repetition_penalty"):
            out[key] = _num(name, v)
        elif key == "top_k":
            out[key] = _int(name, v, 0, 2**31 - 1)  # int32 on the wire to the verifier/drafter
        elif key == "seed":
            out[key] = _int(name, v, 0, 2**63 - 1)
        elif key == "num_draft_tokens":
            out[key] = _int(name, v, 1, 64)
        else:
            out[key] = _bool(name, v)
    sp = {k: out[k] for k in ("temperature", "top_k", "top_p", "repetition_penalty") if k in out}
    try:
        SamplingParams(**sp)
    except InvalidArgument as e:
        raise InvalidArgument(names.get(e.field, e.field), str(e).split(": ", 1)[-1]) from None
    return out


def check_utf8(name: str, text: str) -> None:
    """JSON can carry lone surrogates ("\\ud800"); they have no UTF-8 form (tokenisers and gRPC need one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(name, f"is not valid UTF-8 (unpaired surrogate at character {e.start})") from None


def validate_messages(messages, field: str = "messages") -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(field, "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidArgument(f"{field}[{i}]", "must be an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant"):
            raise InvalidArgument(f"{field}[{i}].role", f"must be system, user or assistant, got {role!r}")
        if not isinstance(content, str):
            raise InvalidArgument(f"{field}[{i}].content", "must be a string")
        check_utf8(f"{field}[{i}].content", content)
        out.append({"role": role, "content": content})
    return out


def check_input(cfg: GatewayConfig, prompt, messages, names: dict | None = None, *, session: bool = False):
    """A request's input: exactly one of a prompt (a string of at most ``cfg.max_prompt_chars``
    characters, valid UTF-8, not empty unless it continues a session) or messages (at most as long
    together). Returns the messages validated (None for a prompt). Field names as the caller's API
    spells them (``names``)."""
    names = names or {}
    pname, mname = names.get("prompt", "prompt"), names.get("messages", "messages")
    if (prompt is None) == (messages is None):
        raise InvalidArgument(pname, "give exactly one of prompt or messages")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidArgument(pname, "must be a string")
        if len(prompt) > cfg.max_prompt_chars:
            raise InvalidArgument(pname, f"is longer than {cfg.max_prompt_chars} characters")
        check_utf8(pname, prompt)
        if not prompt and not session:
            raise InvalidArgument(pname, "must not be empty")
        return None
    messages = validate_messages(messages, mname)
    if sum(len(m["content"]) for m in messages) > cfg.max_prompt_chars:
        raise InvalidArgument(mname, f"are longer than {cfg.max_prompt_chars} characters")
    return messages


def _bearer(authorization: str | None) -> str:
    """The key of an "Authorization: Bearer <key>" header ("" if it is not one)."""
    token = (authorization or "").strip()
    return token[7:].strip() if token[:7].lower() == "bearer " else ""


def check_api_key(cfg: GatewayConfig, authorization: str | None) -> None:
    """Raise Unauthenticated unless keys are off or `authorization` is "Bearer <a configured key>"."""
    if not cfg.api_keys:
        return
    import hmac

    token = _bearer(authorization)
    if not token or not any(hmac.compare_digest(token, k) for k in cfg.api_keys):
        raise Unauthenticated("authorization: missing or invalid API key (send 'Authorization: Bearer <key>')")


class Admission:
    """How many generations run at once (``limit``) and how many may wait for a slot (``queue``,
    each up to ``wait_s``); past both, requests are refused at once with RESOURCE_EXHAUSTED (HTTP
    429 + Retry-After). Only generations take slots: health, metrics, sessions and tokenization
    never wait behind them."""

    def __init__(self, limit: int, queue: int, wait_s: float):
        self.limit, self.queue, self.wait_s = int(limit), int(queue), float(wait_s)
        self.active = 0
        self.waiting = 0
        self._cv = threading.Condition()

    def _refuse(self, why: str) -> ResourceExhausted:
        return ResourceExhausted(f"the gateway is at capacity ({self.active} requests running, {self.waiting} "
                                 f"waiting): {why}; retry later")

    def enter_nowait(self) -> bool:
        """True: a slot is taken; False: queued (then :meth:`wait` or poll :meth:`promote`)."""
        with self._cv:
            if self.active < self.limit and self.waiting == 0:
                self.active += 1
                return True
            if self.waiting >= self.queue:
                raise self._refuse("the wait queue is full")
            self.waiting += 1
            return False

    def promote(self) -> bool:
        """A queued caller takes a free slot, if there is one."""
        with self._cv:
            if self.active < self.limit:
                self.active += 1
                self.waiting -= 1
                return True
            return False

    def abandon(self) -> ResourceExhausted:
        """A queued caller gives up (waited too long): the error to raise."""
        with self._cv:
            self.waiting -= 1
            return self._refuse(f"no slot within {self.wait_s:g} s")

    def enter(self) -> None:
        """Take a slot, waiting in the queue up to ``wait_s`` (blocking: gRPC handler threads)."""
        if self.enter_nowait():
            return
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while True:
                if self.active < self.limit:
                    self.active += 1
                    self.waiting -= 1
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
        raise self.abandon()

    async def enter_async(self) -> None:
        """Take a slot without blocking the event loop (REST): poll while queued."""
        import anyio

        if self.enter_nowait():
            return
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            if self.promote():
                return
            await anyio.sleep(0.01)
        raise self.abandon()

    def leave(self) -> None:
        with self._cv:
            self.active -= 1
            self._cv.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no generation runs or waits (a drain); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self.active or self.waiting:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.2))
        return True


def key_owner(cfg: GatewayConfig, authorization: str | None) -> str:
    """Who owns the sessions a caller creates: a hash of its API key ("" with keys off). Redis
    stores this, never the key."""
    if not cfg.api_keys:
        return ""
    import hashlib

    token = _bearer(authorization)
    return hashlib.sha256(b"crossdraft-session-owner\0" + token.encode("utf-8", "replace")).hexdigest()


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("crossdraft_requests_total", "Requests by API and outcome", ["api", "status"],
                                registry=r)
        self.tokens = Counter("crossdraft_completion_tokens_total", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("crossdraft_prompt_tokens_total", "Prompt tokens", registry=r)
        self.forks = Counter("crossdraft_prefill_forks_total",
                             "Model-server sessions forked from a shared prompt prefill (n completions)", registry=r)
        self.rounds = Counter("crossdraft_rounds_total", "Verification rounds", registry=r)
        self.drafted = Counter("crossdraft_drafted_tokens_total", "Draft tokens verified", registry=r)
        self.accepted = Counter("crossdraft_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.pos_drafted = Counter("crossdraft_drafted_by_position_total", "Drafts verified at each block position",
                                   ["position"], registry=r)
        self.pos_accepted = Counter("crossdraft_accepted_by_position_total", "Drafts accepted at each block position",
                                    ["position"], registry=r)
        self.round_seconds = Histogram(
            "crossdraft_round_seconds", "Round latency split by phase", ["phase"], registry=r,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
        self.fallbacks = Counter("crossdraft_drafter_fallbacks_total", "Requests that went on target-only", registry=r)
        self.active = Gauge("crossdraft_active_requests", "Requests in progress", registry=r)
        self.queued = Gauge("crossdraft_queued_requests", "Requests waiting for a slot (--max-concurrent-requests)",
                            registry=r)
        self.placement_retries = Counter(
            "crossdraft_placement_retries_total",
            "Requests moved to another replica because the chosen one refused them before their first token "
            "(reason: resource_exhausted or unavailable)", ["kind", "reason"], registry=r)

    def round(self, ev) -> None:
        self.rounds.inc()
        self.drafted.inc(ev.drafted)
        self.accepted.inc(ev.accepted)
        for i in range(ev.drafted):
            self.pos_drafted.labels(str(i)).inc()
            if i < ev.accepted:
                self.pos_accepted.labels(str(i)).inc()
        self.round_seconds.labels("draft").observe(ev.draft_s)
        self.round_seconds.labels("verify").observe(ev.verify_s)
        self.round_seconds.labels("overhead").observe(ev.overhead_s)


def stats_dict(stats) -> dict:
    d = stats.to_dict()
    return {
        "mode": d["mode"], "draft_mode": d["draft_mode"], "draws": d["draws"], "rounds": d["rounds"],
        "drafted": d["drafted"],
        "accepted": d["accepted"], "acceptance_rate": d["acceptance_rate"],
        "acceptance_by_position": d["acceptance_by_position"], "resyncs": d["resyncs"],
        "skipped_rounds": d["skipped_rounds"], "drafter_fallback": d["drafter_fallback"],
        "fallback_reason": d["fallback_reason"], "prefill_ms": d["prefill_s"] * 1e3, "draft_ms": d["draft_s"] * 1e3,
        "verify_ms": d["verify_s"] * 1e3, "overhead_ms": d["overhead_s"] * 1e3, "total_ms": d["total_s"] * 1e3,
        "reused_target_tokens": d["reused_target_tokens"], "reused_drafter_tokens": d["reused_drafter_tokens"],
    }


def add_stats(total: dict, s: dict) -> dict:
    """Stats of two runs added up (counts and times summed, acceptance recomputed)."""
    out = dict(total)
    for k in ("rounds", "drafted", "accepted", "resyncs", "skipped_rounds", "prefill_ms", "draft_ms", "verify_ms",
              "overhead_ms", "total_ms", "reused_target_tokens", "reused_drafter_tokens"):
        out[k] = out.get(k, 0) + s.get(k, 0)
    out["acceptance_rate"] = out["accepted"] / out["drafted"] if out.get("drafted") else 0.0
    out["mode"], out["draft_mode"], out["draws"] = s["mode"], s["draft_mode"], s["draws"]
    out["drafter_fallback"] = bool(total.get("drafter_fallback")) or s["drafter_fallback"]
    out["fallback_reason"] = s["fallback_reason"] or total.get("fallback_reason", "")
    return out


class Gateway:
    """placement: a :class:`gateway.discovery.Placement` over the verifier and drafter pools."""

    def __init__(self, cfg: GatewayConfig, pair: TokenPair, placement, store: RedisSessionStore, *,
                 tracer=None, metrics: Metrics | None = None, eos_ids=(), max_context: int = 0):
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
        self._lock = threading.Lock()  # the decoders (decoder() holds it over a replica's first info call)
        # the latest readiness check, (checked, ok, details, stale_since), stale_since = since which
        # check every verifier has served another revision (None: not so). readiness() builds a new
        # tuple and publishes it with one assignment; readers take the reference without a lock, so
        # the liveness probe (stale_pairing) never waits on _lock, which decoder() holds over a remote
        # call. _publish orders the publications and is held over no remote call.
        self._ready_cache: tuple | None = None
        self._publish = threading.Lock()
        self.draining = False  # SIGTERM: not ready, no new generations; in-flight ones finish
        v = placement.any_client("verifier")
        self.model_name = v.info().get("model_name", "target") if v is not None else "target"
        d = placement.any_client("drafter")
        self.drafter_model = d.info().get("model_name") if d is not None else None
        # the Hub commit each model is paired at ("" = catalog model or local path); see revision_conflict
        self.model_revision = (v.info().get("revision") or "") if v is not None else ""
        self.drafter_revision = (d.info().get("revision") or "") if d is not None else ""
        self.has_drafter = pair.drafter_tok is not None and placement.pools["drafter"] is not None

    def revision_conflict(self, kind: str, addr: str, refresh: bool = False) -> str | None:
        """Why the `kind` replica at `addr` may not be paired, or None: it serves the model this gateway
        pairs, by name, at another revision (other weights, maybe another tokenizer or EOS ids)."""
        name, rev = ((self.model_name, self.model_revision) if kind == "verifier"
                     else (self.drafter_model, self.drafter_revision))
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

    def decoder(self, v_addr: str, d_addr: str | None) -> Decoder:
        """One Decoder per (verifier pod, drafter pod): it remembers which masks that drafter has."""
        key = (v_addr, d_addr)
        with self._lock:
            dec = self._decoders.get(key)
            if dec is None:
                why = self.revision_conflict("verifier", v_addr)
                if why:
                    raise Unavailable(why)
                v = self.placement.client("verifier", v_addr)
                d = self.placement.client("drafter", d_addr) if d_addr else None
                dec = self._decoders[key] = Decoder(self.pair, v, d, eos_ids=self.eos_ids, max_context=self.max_context,
                                                    check_context=True, drafter_timeout_s=self.cfg.drafter_timeout_s,
                                                    round_log=self.cfg.round_log,
                                                    colocated=colocated(self.cfg.colocated, v_addr, d_addr))
            return dec

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
        for kind in ("verifier", "drafter"):
            pool = self.placement.pools[kind]
            if pool is None:
                continue
            states = {addr: self._health(kind, addr) for addr in pool.addresses()}
            for addr, st in states.items():  # a replica of another revision is refused, like one that is down
                why = None
                with contextlib.suppress(Exception):  # a probe answers, never raises
                    why = self.revision_conflict(kind, addr, refresh=True) if st == "SERVING" else None
                if why:
                    states[addr] = f"REFUSED ({why})"
            details[kind + "s"] = states
            if kind == "verifier" and (not states or any(s != "SERVING" for s in states.values())):
                ok = False
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
                            if ("verifier", k[0]) in gone or (k[1] is not None and ("drafter", k[1]) in gone)]:
                    del self._decoders[key]
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

    def end_on_servers(self, sid: str, v_addr: str | None, d_addr: str | None) -> None:
        for kind, addr in (("verifier", v_addr), ("drafter", d_addr)):
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
        self.end_on_servers(server_session_id(s.session_id, s.owner), s.verifier_address, s.drafter_address)
        return existed

    # ---- generation --------------------------------------------------------------------------
    def share_prefill(self, jobs: list["Job"]) -> int:
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
                d = self.placement.client("drafter", base.d_addr)
                d.sync(base.sid, base.d_ids, prefill=True)
                for j in jobs[1:]:
                    if j.use_drafter and j.d_addr == base.d_addr and j.d_ids == base.d_ids:
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
              owner: str = "", top_logprobs: int = -1, like: "Job | None" = None) -> "Job":
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

    def _start(self, session_id, prompt, messages, options, api, names, stop, owner, top_logprobs, like) -> "Job":
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


def draft_config(opts: dict, params: SamplingParams, default_k: int) -> DraftConfig:
    """A request's drafting settings. Sampling without a seed of the caller's (one-off requests;
    sessions always have one) prices drafting with the measured costs and the load, as greedy
    decoding does. A seeded one does too where the verifier has coupled draws (Job sets
    ``params.coupled``; the Decoder's "auto" then measures): its text is then the same whatever is
    drafted. Only with the rejection rule (an older verifier) does a seed need static costs to
    replay, since there the text depends on the blocks drafted. With 16 clients on this 2-vCPU
    machine, static costs kept every sampling session drafting where drafting no longer paid (28 vs
    43 tok/s greedy)."""
    k = opts.get("num_draft_tokens", default_k)
    cost_model = "measured" if not params.greedy and "seed" not in opts else "auto"
    return DraftConfig(num_draft_tokens=k, adaptive=opts.get("adaptive_draft", True), max_draft_tokens=max(10, k),
                       cost_model=cost_model)


class Job:
    """One prepared request; iterate :meth:`events` for {"type": "delta" | "done", ...} dicts."""

    def __init__(self, gw: Gateway, session: Session | None, lease, prompt, messages, opts, api, names, stop=(),
                 top_logprobs: int = -1, like: "Job | None" = None):
        self.gw, self.session, self.lease, self.api = gw, session, lease, api
        self._finished = False
        self._placed = False
        self.run = None
        self._v_held: str | None = None  # the verifier replica whose placement slot this job holds
        self._refused: list[tuple[str, Exception]] = []  # (verifier address, its refusal) of this request
        self.admitted = False  # holds an admission slot (given back by close())
        self._cancel = threading.Event()
        self._placement: dict = {}
        self._lease_renewed = time.monotonic()
        self.sid = None
        pair = gw.pair
        merged = dict(session.options) if session else {}
        merged.update(opts)
        self.opts = merged
        self.max_new_tokens = merged.get("max_new_tokens", gw.cfg.default_max_new_tokens)
        self.params = self._base_params = SamplingParams(
            temperature=merged.get("temperature", gw.cfg.default_temperature), top_k=merged.get("top_k", 0),
            top_p=merged.get("top_p", 1.0), repetition_penalty=merged.get("repetition_penalty", 1.0))
        self.seed = merged.get("seed", 0 if self.params.greedy else random.getrandbits(62))
        self.draft = draft_config(merged, self.params, gw.cfg.default_num_draft_tokens)
        pl = gw.placement
        self.v_addr, _ = pl.choose("verifier", like.v_addr if like else session.verifier_address if session else None)
        if self.v_addr is None:
            raise Unavailable("no ready verifier")
        self.use_drafter = merged.get("use_drafter", True) and gw.has_drafter
        self.d_addr = None
        self.no_drafter_reason = ""
        if self.use_drafter:
            self.d_addr, _ = pl.choose("drafter", like.d_addr if like else session.drafter_address if session else None)
            if self.d_addr is None:
                self.use_drafter = False
                self.no_drafter_reason = "no ready drafter"
            else:  # a replica serving another revision of the drafter is not paired: target-only
                why = None
                with contextlib.suppress(Exception):  # an unreachable drafter fails later, as before
                    why = gw.revision_conflict("drafter", self.d_addr)
                if why:
                    self.use_drafter, self.no_drafter_reason, self.d_addr = False, why, None
        self.messages = None
        kind = "chat" if messages is not None else "text"
        if session is not None and session.kind and session.kind != kind:
            raise InvalidArgument(names.get("prompt" if kind == "text" else "messages", kind),
                                  f"session {session.session_id!r} is a {session.kind} session")
        self.kind = kind
        has_d = pair.drafter_tok is not None
        if kind == "chat":
            self.messages = (session.messages if session else []) + messages
            t_ids, d_ids = pair.chat_ids(self.messages, gw.model_name)
        elif session is not None and session.target_ids:
            t_ids = session.target_ids + list(pair.target_tok(prompt, add_special_tokens=False)["input_ids"])
            d_ids = (session.drafter_ids + list(pair.drafter_tok(prompt, add_special_tokens=False)["input_ids"])
                     if has_d and session.drafter_ids
                     else (pair.encode_drafter(pair.target_tok.decode(t_ids)) if has_d else None))
        else:
            if not prompt:
                raise InvalidArgument(names.get("prompt", "prompt"), "must not be empty")
            t_ids = pair.encode_target(prompt)
            d_ids = pair.encode_drafter(prompt) if has_d else None
        if not t_ids:
            raise InvalidArgument(names.get("prompt", "prompt"), "is empty after tokenisation")
        self.prompt_text = prompt
        self.t_ids, self.d_ids = t_ids, d_ids
        self.sid = server_session_id(session.session_id, session.owner) if session else f"oneoff-{uuid.uuid4().hex}"
        self.prompt_tokens = len(t_ids)
        self._names, self._stop, self._top_logprobs = names, stop, top_logprobs
        self._place(self.v_addr)

    def _start_run(self, addr: str) -> None:
        """Prepare the run on the verifier at `addr` (its first round runs when :meth:`events` asks)."""
        gw = self.gw
        params = self._base_params
        # a seeded sampling request gets coupled draws where the verifier has them: its text is then a
        # function of (seed, prompt) alone -- the same with or without a drafter, under any load
        if not params.greedy and "seed" in self.opts and gw.supports("verifier", addr, "coupled_draws"):
            params = dataclasses.replace(params, coupled=True)
        names, session = self._names, self.session
        try:
            run = gw.decoder(addr, self.d_addr).run(
                self.sid, self.t_ids, self.d_ids, max_new_tokens=self.max_new_tokens, params=params, seed=self.seed,
                draft=self.draft, round_start=session.round_index if session else 0, use_drafter=self.use_drafter,
                round_scope=self._round_scope, stop=self._stop, top_logprobs=self._top_logprobs)
        except InvalidArgument as e:  # e.g. prompt + max_new_tokens past the context: in the caller's field names
            name = names.get(e.field, e.field)
            if name == e.field:
                raise
            msg = str(e).split(": ", 1)[-1].replace(e.field, name)
            raise InvalidArgument(name, msg) from None
        self.v_addr, self.params, self.run = addr, params, run
        gw.placement.acquire("verifier", addr)
        self._v_held = addr
        if not self._placed:
            gw.placement.acquire("drafter", self.d_addr)
            self._placed = True

    def _place(self, addr: str, refusal: Exception | None = None) -> None:
        """Start the run on the verifier at `addr`; with `refusal` (how that replica refused the
        run's first round), on the next one instead. The one place where a request changes replica:
        until its first token, each replica that refuses it (RESOURCE_EXHAUSTED: its KV pool is full
        of busy sessions; UNAVAILABLE: down, draining, unreachable, another revision) is left for the
        least-loaded ready replica that has not refused it yet. The new replica builds the session's
        KV cache from the ids the run sends. With none left, the error names every refusal: 429
        (ResourceExhausted) when every replica was full, else 503 (Unavailable)."""
        while True:
            if refusal is not None:
                self._refused.append((addr, refusal))
                if self._v_held == addr:  # the refused run held the replica's slot and, one-off, its server session
                    self._v_held = None
                    self.gw.placement.release("verifier", addr)
                    if self.session is None and isinstance(refusal, ResourceExhausted):
                        self.gw.end_on_servers(self.sid, addr, None)  # (it answers: free what it holds of it)
                nxt, _ = self.gw.placement.choose("verifier", None, exclude={a for a, _ in self._refused})
                if nxt is None:
                    raise refused_error("verifier", self._refused)
                reason = "resource_exhausted" if isinstance(refusal, ResourceExhausted) else "unavailable"
                self.gw.metrics.placement_retries.labels("verifier", reason).inc()
                log.warning("verifier %s refused request %s before its first token (%s): moving it to %s",
                            addr, self.sid, refusal, nxt)
                addr, refusal = nxt, None
            try:
                self._start_run(addr)
                return
            except (ResourceExhausted, Unavailable) as e:  # e.g. no ModelInfo from a stopped replica
                refusal = e

    def _round_scope(self, round_index):
        gw = self.gw

        @contextlib.contextmanager
        def scope():
            with gw.tracer.start_as_current_span("crossdraft.verify_round") as span:
                span.set_attribute("crossdraft.round.index", round_index)

                def record(ev):
                    span.set_attribute("crossdraft.round.draft_tokens_requested", ev.requested)
                    span.set_attribute("crossdraft.round.drafted", ev.drafted)
                    span.set_attribute("crossdraft.round.accepted", ev.accepted)
                    span.set_attribute("crossdraft.round.emitted", len(ev.emitted))
                    span.set_attribute("crossdraft.round.draft_ms", ev.draft_s * 1e3)
                    span.set_attribute("crossdraft.round.verify_ms", ev.verify_s * 1e3)
                    span.set_attribute("crossdraft.round.overhead_ms", ev.overhead_s * 1e3)
                    span.set_attribute("crossdraft.round.batch_size", ev.batch_size)
                    span.set_attribute("crossdraft.round.queue_wait_ms", ev.queue_wait_s * 1e3)
                    gw.metrics.round(ev)

                yield record

        return scope()

    def cancel(self) -> None:
        """The client went away (disconnect, cancelled call, deadline): stop before the next round.
        Safe from any thread; the round in flight finishes, then the request ends, counted as
        ``cancelled``, and a one-off request's sessions are dropped on both servers at once. A
        session's cancelled turn is dropped whole, like a failed one: the stored session stays as
        it was before the turn (what was streamed of it is not part of the session), so the same
        request sent again continues from the same state and, greedy or seeded, gives the same
        text. A turn counts once the gateway commits it, just before its final ``done`` event."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def events(self, ctx=None):
        """Generator of event dicts; runs the rounds. `ctx`: OTel context to run under (REST).
        A session's turn is stored once, when it completes (:meth:`_commit`); an error or a
        cancellation before that leaves the stored session untouched."""
        gw = self.gw
        gw.metrics.active.inc()
        status = "error"
        try:
            first = True
            while True:
                if self._cancel.is_set():
                    status = "cancelled"
                    self.run.close()
                    return
                token = otel_context.attach(ctx) if ctx is not None else None
                try:
                    ev = self._first_round() if first else next(self.run, None)
                finally:
                    if token is not None:
                        otel_context.detach(token)
                if first and self.session is not None:
                    self._record_placement()
                first = False
                if ev is None:
                    break
                if self.session is not None:
                    self._keep_lease()
                if ev.text or ev.emitted:
                    yield {"type": "delta", "text": ev.text, "token_ids": list(ev.emitted), "logprobs": ev.logprobs}
            res = self.run.result
            if self.no_drafter_reason and not res.stats.drafter_fallback:
                res.stats.drafter_fallback, res.stats.fallback_reason = True, self.no_drafter_reason
            st = stats_dict(res.stats)
            if res.stats.drafter_fallback:
                gw.metrics.fallbacks.inc()
            gw.metrics.tokens.inc(len(res.token_ids))
            gw.metrics.prompt_tokens.inc(self.prompt_tokens)
            if self.session is not None:
                self._commit(res, st)
            status = "ok"
            done = {"type": "done", "session_id": self.session.session_id if self.session else "",
                    "finish_reason": res.stats.finish_reason, "text": res.text,
                    "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(res.token_ids),
                              "total_tokens": self.prompt_tokens + len(res.token_ids)},
                    "stats": st, "token_ids": list(res.token_ids), "logprobs": res.logprobs}
            # release the session before the client sees the end: its next request may follow at once
            self._finish(status)
            yield done
        finally:
            if status == "error" and self._cancel.is_set():
                status = "cancelled"  # the consumer stopped reading us because the client went away
            self._finish(status)

    def _first_round(self):
        """The run's first round (syncs, prefill, first verification). A replica that refuses it
        has produced no token: the run starts again on another replica (:meth:`_place`). Later
        rounds are never moved: the client may have seen their output."""
        while True:
            try:
                return next(self.run, None)
            except (ResourceExhausted, Unavailable) as e:
                if self._cancel.is_set():
                    raise
                self.run.close()
                self._place(self.v_addr, e)

    def _record_placement(self) -> None:
        """Where this session's caches live now (stored when the turn commits). The drafter's
        instance is best effort: a drafter that cannot answer leaves the request target-only."""
        pl = self.gw.placement
        d_instance = ""
        if self.d_addr:
            with contextlib.suppress(ResourceExhausted, Unavailable):
                d_instance = pl.client("drafter", self.d_addr).instance_id
        self._placement = {"verifier_address": self.v_addr,
                           "verifier_instance": pl.client("verifier", self.v_addr).instance_id,
                           "drafter_address": self.d_addr or "", "drafter_instance": d_instance}

    def _keep_lease(self) -> None:
        """Renew the session's lease a quarter of its life after the last renewal: a turn longer
        than the lease keeps it, so that its commit finds it still its own."""
        now = time.monotonic()
        if now - self._lease_renewed >= self.gw.store.lease_ms / 4000.0:
            self._lease_renewed = now
            self.gw.store.renew(self.session, self.lease)

    def _commit(self, res, st: dict) -> None:
        """Store the completed turn: the session's ids on both sides, round counter, turns, text or
        messages, totals and placement change together, in one write (RedisSessionStore.commit).
        Nothing is written before this: a turn that fails or is cancelled part-way leaves the
        stored session as it was before the turn, and the model servers' caches, which may hold
        the partial turn, are realigned with the stored ids by the next turn's sync (each keeps
        the longest common prefix; the reply's reused_target_tokens / reused_drafter_tokens count it)."""
        new = copy.copy(self.session)  # (the pre-turn session stays as it was read)
        new.__dict__.update(self._placement)
        new.target_ids = list(self.run.target_ids)
        if self.run.drafter_ids is not None:
            new.drafter_ids = list(self.run.drafter_ids)
        new.round_index = self.run.next_round
        new.kind = self.kind
        new.turns += 1
        if self.kind == "chat":
            new.messages = self.messages + [{"role": "assistant", "content": res.text}]
        else:
            # the session's text spells its tokens: a stop string stays in it (not in the reply)
            new.text += (self.prompt_text or "") + res.text + res.stop_tail
        new.stats = add_stats(new.stats, st)
        self.gw.store.commit(new, self.lease)
        self.session = new

    def _finish(self, status: str) -> None:
        if self._finished:
            return
        self._finished = True
        self.gw.metrics.active.dec()
        self.gw.metrics.requests.labels(self.api, status).inc()
        self.close()

    def close(self) -> None:
        if self.admitted:
            self.admitted = False
            self.gw.admission.leave()
        if self.lease and self.session is not None:
            self.gw.store.release(self.session, self.lease)
            self.lease = None
        if self._v_held:
            self.gw.placement.release("verifier", self._v_held)
            self._v_held = None
        if self._placed:
            self._placed = False
            self.gw.placement.release("drafter", self.d_addr)
        if self.session is None and self.sid:
            sid, self.sid = self.sid, None
            self.gw.end_on_servers(sid, self.v_addr, self.d_addr)


def _refusal(kind: str, addr: str, e: Exception) -> str:
    """One refusal as "<address> <status> (<why>)", the status being the gRPC code the replica answered."""
    code = "RESOURCE_EXHAUSTED" if isinstance(e, ResourceExhausted) else "UNAVAILABLE"
    why = str(e)
    # the clients' messages begin "<kind> <address>: " or "<kind> <address> <CODE>: " (clients._convert)
    m = re.match(rf"{re.escape(kind)} {re.escape(addr)}(?: ([A-Z_]+))?: (.*)\Z", why, re.S)
    if m:
        code = m.group(1) if m.group(1) and not isinstance(e, ResourceExhausted) else code
        why = m.group(2)
    return f"{addr} {code} ({why})"


def refused_error(kind: str, refused: list[tuple[str, Exception]]) -> Exception:
    """The error of a request every ready `kind` replica refused: it names each replica and why;
    ResourceExhausted (429 / RESOURCE_EXHAUSTED) when every refusal was one (full: retry later),
    else Unavailable (503 / UNAVAILABLE)."""
    msg = f"no {kind} replica accepted the request: " + ", ".join(_refusal(kind, a, e) for a, e in refused)
    if all(isinstance(e, ResourceExhausted) for _, e in refused):
        return ResourceExhausted(msg)
    return Unavailable(msg)


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


def colocated(setting: str, v_addr: str, d_addr: str | None) -> bool:
    """Whether the drafter at d_addr computes on the same hardware as the verifier at v_addr: "yes",
    "no", or "auto" -- both on this host's loopback, or the same host."""
    if setting in ("yes", "no"):
        return setting == "yes"
    if not d_addr:
        return False
    hv, hd = _host(v_addr), _host(d_addr)

    def local(h: str) -> bool:
        return h in _LOOPBACK or h.startswith("127.")

    return (local(hv) and local(hd)) or (hv == hd and hv != "")


__all__ = ["OPTION_FIELDS", "Gateway", "GatewayConfig", "Job", "Metrics", "add_stats", "check_api_key", "check_utf8",
           "key_owner", "refused_error", "validate_messages", "validate_options"]
