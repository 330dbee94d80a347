"""One generation request: :class:`Job` holds what a request needs from its validation to its end
-- options, tokens, the verifier and drafter replicas it runs on, the admission slot and session
lease it holds -- and runs its rounds as a stream of events. It moves to another verifier replica
when one refuses it before its first token (:meth:`Job._place`), stores a session's turn once it
completes (:meth:`Job._commit`), and gives back everything it holds when it ends (:meth:`Job.close`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import queue
import random
import re
import threading
import time
import uuid
from typing import TYPE_CHECKING

from opentelemetry import context as otel_context
from opentelemetry import trace

from crossdraft.decoding.policy import DraftConfig
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument, ResourceExhausted, Unavailable

from .metrics import add_stats, stats_dict
from .pool import PoolChoice, kind_models, prior_order, text_class
from .sessions import Session, server_session_id

if TYPE_CHECKING:
    from .core import Gateway

log = logging.getLogger("crossdraft.gateway")


def draft_config(opts: dict, params: SamplingParams, default_k: int) -> DraftConfig:
    """A request's drafting settings. Sampling without a seed of the caller's (one-off requests;
    sessions always have one) prices drafting with the measured costs and the load, as greedy
    decoding does. A seeded one does too where the verifier has coupled draws (Job sets
    ``params.coupled``; the Decoder's "auto" then measures): its text is then the same whatever is
    drafted. Only with the rejection rule (an older verifier) does a seed need static costs to
    replay, since there the text depends on the blocks drafted. Static costs ignore the load: under
    many clients they keep a sampling session drafting where drafting no longer pays."""
    k = opts.get("num_draft_tokens", default_k)
    cost_model = "measured" if not params.greedy and "seed" not in opts else "auto"
    return DraftConfig(num_draft_tokens=k, adaptive=opts.get("adaptive_draft", True), max_draft_tokens=max(10, k),
                       cost_model=cost_model)


class Job:
    """One prepared request; iterate :meth:`events` for {"type": "delta" | "done", ...} dicts."""

    def __init__(self, gw: Gateway, session: Session | None, lease, prompt, messages, opts, api, names, stop=(),
                 top_logprobs: int = -1, like: Job | None = None):
        self.gw, self.session, self.lease, self.api = gw, session, lease, api
        self._names, self._stop, self._top_logprobs = names, stop, top_logprobs
        self._finished = False
        self._placed = False  # holds the drafter replica's placement count (given back by close())
        self.run = None
        self._v_held: str | None = None  # the verifier replica whose placement slot this job holds
        self._refused: list[tuple[str, Exception]] = []  # (verifier address, its refusal) of this request
        self.admitted = False  # holds an admission slot (given back by close())
        self._cancel = threading.Event()
        self._round_span: tuple | None = None  # (span, end ns) of the round that just ended (_round_scope)
        self._placement: dict = {}
        self._lease_renewed = time.monotonic()
        self.sid = None
        self.d_key, self.d_kind = "drafter", None  # the drafter kind (placement key, DrafterKind) the job drafts with
        self.pool: PoolChoice | None = None  # the choice among the drafter kinds (one or more) and none
        self._text_class = ""  # a new session's prompt class: what its pool measurements teach (PoolPriors)
        self.pool_none = False  # its class's estimates say no kind pays: it runs target-only (PoolChoice.none_pays)
        self._abandoned: list[tuple[str, str]] = []  # (key, address) of drafters the job moved away from
        self._settings(opts)
        self.kind = self._kind(messages)
        self._choose_replicas(like, prompt, messages)
        self.messages = (session.messages if session else []) + messages if self.kind == "chat" else None
        self.prompt_text = prompt
        self.t_ids, self.d_ids = self._prompt_ids(prompt)
        self.prompt_tokens = len(self.t_ids)
        self.sid = server_session_id(session.session_id, session.owner) if session else f"oneoff-{uuid.uuid4().hex}"
        self._place(self.v_addr)

    def _settings(self, opts: dict) -> None:
        """The request's options over its session's; sampling, seed and drafting settings from them."""
        cfg = self.gw.cfg
        merged = dict(self.session.options) if self.session else {}
        merged.update(opts)
        self.opts = merged
        self.max_new_tokens = merged.get("max_new_tokens", cfg.default_max_new_tokens)
        self.params = self._base_params = SamplingParams(
            temperature=merged.get("temperature", cfg.default_temperature), top_k=merged.get("top_k", 0),
            top_p=merged.get("top_p", 1.0), repetition_penalty=merged.get("repetition_penalty", 1.0))
        self.seed = merged.get("seed", 0 if self.params.greedy else random.getrandbits(62))
        self.draft = draft_config(merged, self.params, cfg.default_num_draft_tokens)

    def _recorded(self, like: Job | None, kind: str) -> str | None:
        """The replica of `kind` ("verifier", or a drafter kind's placement key) this request should stay
        on: its sibling's (n completions), else the one its session's caches live on, else none."""
        if like is not None:
            if kind == "verifier":
                return like.v_addr
            return like.d_addr if like.d_key == kind else None
        if self.session is not None:
            if kind == "verifier":
                return self.session.verifier_address
            return self.session.drafter_address if self._session_kind() == kind else None
        return None

    def _session_kind(self) -> str | None:
        """The placement key of the drafter kind the session's drafter ids and address belong to."""
        k = self.gw.kind(self.session.drafter_kind) if self.session.drafter_kind else self.gw.first_kind()
        return k.key if k is not None else None

    def _choose_replicas(self, like: Job | None, prompt=None, messages=None) -> None:
        """A verifier (Unavailable without one) and, if the request drafts, a drafter kind and a replica
        of it: the kind the session's measurements (else, with a pool of kinds, the prompt's spelling)
        put first that has a ready replica of the paired revision (:class:`gateway.pool.PoolChoice`);
        without any, the request runs target-only, saying why. A new session whose prompt's class measured
        every kind (the one drafter too) as not worth drafting runs target-only (PoolChoice.none_pays)."""
        gw = self.gw
        self.v_addr, _ = gw.placement.choose("verifier", self._recorded(like, "verifier"))
        if self.v_addr is None:
            raise Unavailable("no ready verifier")
        self.use_drafter = self.opts.get("use_drafter", True) and gw.has_drafter
        self.d_addr = None
        self.no_drafter_reason = ""
        if not self.use_drafter:
            return
        kinds = list(gw.kinds.values())
        names = [k.name for k in kinds]
        if like is not None and like.d_kind is not None:
            names = [like.d_kind.name] + [n for n in names if n != like.d_kind.name]
        if len(kinds) > 1 or (kinds and self._measures(kinds[0])):  # (one kind: whether a new session drafts at all)
            text = prompt if prompt else " ".join(str(m.get("content", "")) for m in (messages or [])[-2:])
            own = self.session.pool if self.session is not None else None
            prior = None
            if not own:  # a new session: the prompt's spelling orders the kinds; similar requests' measurements first
                self._text_class = text_class(text or "")
                prior = gw.pool_priors.seed(self._text_class, kind_models(kinds))
                if like is None and len(kinds) > 1:
                    names = prior_order(kinds, text or "")
            self.pool = PoolChoice(names, own, self._switch, gw.metrics, prior=prior)
            none = like.pool_none if like is not None else self.draft.adaptive and self.pool.none_pays()
            if none:  # similar requests measured every kind, and none paid: target-only rounds
                self.use_drafter, self.pool_none = False, True
                gw.metrics.pool_choice("", "none")
                return
            if like is None:
                names = self.pool.first()
        for name in names:
            if self._take(gw.kinds[name], self._recorded(like, gw.kinds[name].key)):
                if self.pool is not None:
                    self.pool.started(name, "prior" if self.pool.prior else "start")
                return
            if self.pool is not None:
                self.pool.down.add(name)
        self.use_drafter, self.d_kind, self.d_key = False, None, "drafter"

    def _measures(self, kind) -> bool:
        """Whether this request on drafter `kind` prices drafting with measured costs (DraftConfig.measures;
        the verifier and the kind's replicas timed their forwards: Decoder._policy). A gateway with one
        drafter kind uses what its prompt's class measured only then: with static costs a request's choices
        stay a function of its own tokens (a seeded run replays anywhere), and a value priced from weight
        bytes says little of what drafting is worth here."""
        gw = self.gw
        if not self.draft.measures(self._params(self.v_addr)):
            return False
        try:
            d_addr, _ = gw.placement.choose(kind.key, None)
            return (d_addr is not None and bool(gw.placement.client("verifier", self.v_addr).info().get("forward_ms"))
                    and bool(gw.placement.client(kind.key, d_addr).info().get("forward_ms")))
        except Exception:  # (a server that cannot be asked now: its run fails over on its own)
            return False

    def _params(self, addr: str) -> SamplingParams:
        """The run's sampling parameters on the verifier at `addr`: a seeded sampling request gets coupled
        draws where the verifier has them -- its text is then a function of (seed, prompt) alone, the same
        with or without a drafter, under any load."""
        params = self._base_params
        if not params.greedy and "seed" in self.opts and self.gw.supports("verifier", addr, "coupled_draws"):
            params = dataclasses.replace(params, coupled=True)
        return params

    def _take(self, kind, recorded: str | None) -> bool:
        """Choose a ready replica of drafter `kind` (the recorded one while it is ready) of the paired
        revision; False (and no_drafter_reason says why) when there is none."""
        gw = self.gw
        addr, _ = gw.placement.choose(kind.key, recorded)
        if addr is None:
            self.no_drafter_reason = "no ready drafter" + (f" of kind {kind.name}" if len(gw.kinds) > 1 else "")
            return False
        why = None
        with contextlib.suppress(Exception):  # an unreachable drafter shows when the run calls it
            why = gw.revision_conflict(kind.key, addr)
        if why:  # a replica serving another revision of the drafter is not paired
            self.no_drafter_reason = why
            return False
        self.d_addr, self.d_key, self.d_kind, self.no_drafter_reason = addr, kind.key, kind, ""
        return True

    def _switch(self, name: str):
        """A pool's request moves to drafter kind `name` (PoolChoice asks between two rounds): the Decoder
        of the run's verifier with a ready replica of that kind, or None when it has none."""
        gw = self.gw
        old = self.d_key, self.d_addr, self.d_kind
        old_key, old_addr = old[0], old[1]
        if not self._take(gw.kinds[name], self._recorded(None, gw.kinds[name].key)):
            return None
        try:
            dec = gw.decoder(self.v_addr, self.d_addr, self.d_key)
        except (Unavailable, ResourceExhausted):
            self.d_key, self.d_addr, self.d_kind = old  # (the request stays on its kind)
            return None
        if self._placed:
            gw.placement.release(old_key, old_addr)
            gw.placement.acquire(self.d_key, self.d_addr)
        if old_addr and (old_key, old_addr) != (self.d_key, self.d_addr):
            self._abandoned.append((old_key, old_addr))
        return dec

    def _kind(self, messages) -> str:
        """"chat" (messages) or "text" (a prompt); a session keeps the kind of its first turn."""
        kind = "chat" if messages is not None else "text"
        session = self.session
        if session is not None and session.kind and session.kind != kind:
            raise InvalidArgument(self._names.get("prompt" if kind == "text" else "messages", kind),
                                  f"session {session.session_id!r} is a {session.kind} session")
        return kind

    def _prompt_ids(self, prompt: str | None) -> tuple[list, list | None]:
        """(target ids, drafter ids or None) of everything the run sends: the chat so far with its
        template, or the session's ids followed by the prompt's, or the prompt alone."""
        gw, session, names = self.gw, self.session, self._names
        pair = self.d_kind.pair if self.d_kind is not None else gw.pair
        has_d = pair.drafter_tok is not None
        # a session's drafter ids are those of the kind it drafted with: another kind re-encodes the text
        same_kind = session is not None and self.d_kind is not None and self._session_kind() == self.d_key
        if self.kind == "chat":
            t_ids, d_ids = pair.chat_ids(self.messages, gw.model_name)
        elif session is not None and session.target_ids:
            t_ids = session.target_ids + list(pair.target_tok(prompt, add_special_tokens=False)["input_ids"])
            d_ids = (session.drafter_ids + list(pair.drafter_tok(prompt, add_special_tokens=False)["input_ids"])
                     if has_d and session.drafter_ids and same_kind
                     else (pair.encode_drafter(pair.target_tok.decode(t_ids)) if has_d else None))
        else:
            if not prompt:
                raise InvalidArgument(names.get("prompt", "prompt"), "must not be empty")
            t_ids = pair.encode_target(prompt)
            d_ids = pair.encode_drafter(prompt) if has_d else None
        if not t_ids:
            raise InvalidArgument(names.get("prompt", "prompt"), "is empty after tokenisation")
        return t_ids, d_ids

    def _start_run(self, addr: str) -> None:
        """Prepare the run on the verifier at `addr` (its first round runs when :meth:`events` asks)."""
        gw = self.gw
        params = self._params(addr)
        names, session = self._names, self.session
        try:
            run = gw.decoder(addr, self.d_addr, self.d_key).run(
                self.sid, self.t_ids, self.d_ids, max_new_tokens=self.max_new_tokens, params=params, seed=self.seed,
                draft=self.draft, round_start=session.round_index if session else 0, use_drafter=self.use_drafter,
                round_scope=self._round_scope, stop=self._stop, top_logprobs=self._top_logprobs,
                chooser=self.pool if self.use_drafter else None)
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
            gw.placement.acquire(self.d_key, self.d_addr)
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
        """The round's trace span, current while the round runs (its Draft and Verify calls are its
        children). The round hands the span and its end time to the reader of its event
        (:meth:`_record`), which sets the attributes, counts the metrics and ends it: that work is
        not on the next round's path."""
        gw = self.gw

        @contextlib.contextmanager
        def scope():
            span = gw.tracer.start_span("crossdraft.verify_round")
            span.set_attribute("crossdraft.round.index", round_index)
            recorded = False

            def record(ev):
                nonlocal recorded
                recorded = True
                self._round_span = (span, time.time_ns())

            try:
                with trace.use_span(span, end_on_exit=False):
                    yield record
            finally:
                if not recorded:  # the round raised: nobody reads an event of it
                    span.end()

        return scope()

    def _record(self, ev, span, end_ns: int) -> None:
        """A round's span attributes and metrics, and the span's end at the round's end."""
        gw = self.gw
        span.set_attribute("crossdraft.round.draft_tokens_requested", ev.requested)
        span.set_attribute("crossdraft.round.drafted", ev.drafted)
        span.set_attribute("crossdraft.round.accepted", ev.accepted)
        span.set_attribute("crossdraft.round.emitted", len(ev.emitted))
        span.set_attribute("crossdraft.round.draft_ms", ev.draft_s * 1e3)
        span.set_attribute("crossdraft.round.verify_ms", ev.verify_s * 1e3)
        span.set_attribute("crossdraft.round.overhead_ms", ev.overhead_s * 1e3)
        span.set_attribute("crossdraft.round.batch_size", ev.batch_size)
        span.set_attribute("crossdraft.round.queue_wait_ms", ev.queue_wait_s * 1e3)
        span.set_attribute("crossdraft.round.draft_queue_wait_ms", ev.draft_queue_s * 1e3)
        span.set_attribute("crossdraft.round.drafted_ahead", ev.drafted_ahead)
        if ev.draft_batch_rows:  # how far the drafter's steps of this block were batched with other sessions'
            span.set_attribute("crossdraft.round.draft_batch_rows", ev.draft_batch_rows)
        if ev.drafter:
            span.set_attribute("crossdraft.round.drafter", ev.drafter)
        if ev.ahead:
            span.set_attribute("crossdraft.round.ahead", ev.ahead)
        if ev.skip_reason:  # a speculative round that drafted nothing: the chooser's reason
            span.set_attribute("crossdraft.round.skip_reason", ev.skip_reason)
        if ev.predicted_s > 0:
            span.set_attribute("crossdraft.round.predicted_tokens", ev.predicted_tokens)
            span.set_attribute("crossdraft.round.predicted_ms", ev.predicted_s * 1e3)
        span.end(end_time=end_ns)
        gw.metrics.round(ev)

    def _produce(self, q: queue.SimpleQueue, ctx) -> None:
        """Run the rounds (in a thread of their own), each as soon as the one before it ends, and hand
        each round's event to :meth:`events` through ``q``: the reader's work on an event (its span and
        metrics, streaming it to the client) is not on the next round's path. Puts ("event", ev, span)
        per round, then ("end", None, None) -- or ("error", exception, None), or ("cancelled", ...)."""
        token = otel_context.attach(ctx) if ctx is not None else None
        try:
            first = True
            while True:
                if self._cancel.is_set():
                    self.run.close()
                    q.put(("cancelled", None, None))
                    return
                self._round_span = None
                ev = self._first_round() if first else next(self.run, None)
                if first and self.session is not None:
                    self._record_placement()
                first = False
                if ev is None:
                    q.put(("end", None, None))
                    return
                q.put(("event", ev, self._round_span))
        except BaseException as e:  # noqa: BLE001 -- handed to the reader, which raises it
            q.put(("error", e, None))
        finally:
            if token is not None:
                otel_context.detach(token)

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
        """Generator of event dicts; the rounds run in a thread of their own (:meth:`_produce`), ahead
        of the reader. `ctx`: OTel context to run under (REST). A session's turn is stored once, when
        it completes (:meth:`_commit`); an error or a cancellation before that leaves the stored
        session untouched."""
        gw = self.gw
        gw.metrics.active.inc()
        status = "error"
        q: queue.SimpleQueue = queue.SimpleQueue()
        # the rounds' spans belong to the caller's trace: its context, or the one current here
        ctx = ctx if ctx is not None else otel_context.get_current()
        rounds = threading.Thread(target=self._produce, args=(q, ctx), name="crossdraft-rounds", daemon=True)
        rounds.start()
        try:
            while True:
                if self._cancel.is_set():
                    status = "cancelled"
                    return
                kind, ev, span = q.get()
                if kind == "error":
                    raise ev
                if kind == "cancelled":
                    status = "cancelled"
                    return
                if kind == "end":
                    break
                if span is not None:
                    self._record(ev, *span)
                if self.session is not None:
                    self._keep_lease()
                if ev.text or ev.emitted:
                    yield {"type": "delta", "text": ev.text, "token_ids": list(ev.emitted), "logprobs": ev.logprobs}
            rounds.join()
            res = self.run.result
            if self.no_drafter_reason and not res.stats.drafter_fallback:
                res.stats.drafter_fallback, res.stats.fallback_reason = True, self.no_drafter_reason
            if self.pool_none:
                res.stats.drafter_choice = "none"
            st = stats_dict(res.stats)
            if res.stats.drafter_fallback:
                gw.metrics.fallbacks.inc()
            gw.metrics.tokens.inc(len(res.token_ids))
            gw.metrics.prompt_tokens.inc(self.prompt_tokens)
            if self.session is not None:
                self._commit(res, st)
            if self.pool_none and self._text_class:
                gw.pool_priors.age(self._text_class)
            elif self.pool is not None and self._text_class:
                gw.pool_priors.learn(self._text_class, self.pool.learned(), kind_models(gw.kinds.values()))
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
            if rounds.is_alive():  # the reader stopped early: the rounds stop after the one in flight
                self._cancel.set()
                rounds.join()
            while True:  # the spans of events nobody read end too
                try:
                    kind, ev, span = q.get_nowait()
                except queue.Empty:
                    break
                if kind == "event" and span is not None:
                    span[0].end(end_time=span[1])
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
        self._placement = {"verifier_address": self.v_addr,
                           "verifier_instance": pl.client("verifier", self.v_addr).instance_id}
        self._placement.update(self._drafter_placement())

    def _drafter_placement(self) -> dict:
        """The session's drafter fields: its kind, replica and that replica's instance (best effort)."""
        d_instance = ""
        if self.d_addr:
            with contextlib.suppress(ResourceExhausted, Unavailable):
                d_instance = self.gw.placement.client(self.d_key, self.d_addr).instance_id
        return {"drafter_address": self.d_addr or "", "drafter_instance": d_instance,
                "drafter_kind": self.d_kind.name if self.d_kind is not None and self.d_addr else ""}

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
        if self._abandoned:  # the run moved to another drafter kind: the session's drafter is that one
            new.__dict__.update(self._drafter_placement())
        if self.pool is not None and not self.pool_none:  # (a turn that chose none by its class measured nothing)
            new.pool = self.pool.snapshot()
        if not self.use_drafter and self.run.drafter_ids is None:
            new.drafter_kind = self.session.drafter_kind  # (a target-only turn keeps the session's kind and ids)
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
        for key, addr in self._abandoned:  # the session's cache on the drafters it left is of no use now
            if (key, addr) != (self.d_key, self.d_addr):
                self.gw.end_on_servers(self.sid, None, addr, key)
        self._abandoned = []

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
            self.gw.placement.release(self.d_key, self.d_addr)
        if self.session is None and self.sid:
            sid, self.sid = self.sid, None
            self.gw.end_on_servers(sid, self.v_addr, self.d_addr, self.d_key)
            for key, addr in self._abandoned:
                self.gw.end_on_servers(sid, None, addr, key)


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
