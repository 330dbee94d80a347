"""REST front end (OpenAI-compatible): /v1/completions, /v1/chat/completions (SSE with
"stream": true), /v1/models, /v1/vocab, /v1/sessions, /tokenize, /detokenize, /healthz, /readyz,
/metrics, /openapi.json. The routes and their handlers live here; the body's parsing in
:mod:`gateway.rest_input`, the responses' JSON in :mod:`gateway.rest_json`, streaming in
:mod:`gateway.rest_stream` and the error mapping in :mod:`gateway.rest_errors`."""

from __future__ import annotations

import functools
import json
import time
import uuid

import anyio
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from crossdraft.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated, Unavailable

from .auth import check_api_key, key_owner
from .rest_errors import error_response, http_error
from .rest_input import REST_OPTIONS, json_body, option_names, split_body, take_option
from .rest_json import completions_json, session_json
from .rest_stream import ClosingStreamingResponse, Completions, sse_events
from .validation import check_utf8, validate_messages

# Worker threads per kind of work (anyio limiters). The rounds of a generation block a thread for as
# long as they run; on a limiter shared with the probes (anyio's default one has 40 threads) a busy
# gateway would make /healthz and /readyz wait until some generation ends. So generation work has a
# limiter sized by the admission limit (admission, not the thread count, bounds the generations), each
# probe one of its own, and the rest (sessions, tokenizer) anyio's default one.
PROBE_THREADS = 2  # per probe endpoint: probes that arrive while two run wait for those, not for work
GENERATION_THREADS_EXTRA = 8  # beyond one per admitted generation: a closing stream, a shared prefill
MAX_DETOKENIZE = 1 << 20  # token ids per /detokenize call
READY_MAX_AGE_S = 2.0  # /readyz: the oldest readiness check of the model servers it answers from


def derive_seed(seed: int, i: int) -> int:
    """The seed of completion i > 0 of a request with ``n`` > 1: a function of the request's seed."""
    import hashlib

    h = hashlib.blake2b(f"crossdraft-n:{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


async def _cancel_on_disconnect(request: Request, jobs: Completions) -> None:
    """Cancel the jobs if the client leaves (the body is read: the next message is the disconnect); the
    rounds stop after the one in flight."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    jobs.cancel()


def _after(head, events):
    """`head`, then the rest of `events` (closed however this generator ends)."""
    try:
        if head is not None:
            yield head
        yield from events
    finally:
        events.close()


def _readiness(g) -> tuple[bool, dict]:
    """(ready, details) for /readyz: the gateway's latest readiness check (a fresh one if it is older
    than READY_MAX_AGE_S) with Redis asked now. A Redis that answers now but did not at that
    check: everything is checked afresh (the check's verdict included Redis)."""
    ok, details = g.readiness(max_age_s=READY_MAX_AGE_S)
    if details.get("draining"):
        return ok, details
    redis_ok = g.store.ping()
    if redis_ok and details.get("redis") != "ok":
        return g.readiness(max_age_s=0.0)
    if not redis_ok:
        return False, dict(details, redis="unreachable")
    return ok, details


class RestApi:
    """The REST handlers over one gateway; gw_ref() is the Gateway, or None while it starts."""

    def __init__(self, gw_ref, tracer=None):
        self.gw_ref = gw_ref
        self.tracer = tracer or trace.get_tracer("crossdraft.gateway")
        self._generation: anyio.CapacityLimiter | None = None  # sized by the gateway's admission limit
        self._liveness = anyio.CapacityLimiter(PROBE_THREADS)
        self._readiness = anyio.CapacityLimiter(PROBE_THREADS)

    def gw(self):
        g = self.gw_ref()
        if g is None:
            raise Unavailable("the gateway is starting")
        return g

    def generation_limiter(self, g) -> anyio.CapacityLimiter:
        """The worker threads of generation work: one per generation the admission lets run, plus a few."""
        if self._generation is None:
            self._generation = anyio.CapacityLimiter(g.cfg.max_concurrent_requests + GENERATION_THREADS_EXTRA)
        return self._generation

    async def _work(self, g, fn, *args):
        """fn(*args) in a generation worker thread: what blocks (Redis, model servers, tokenizers)
        never runs on the event loop, which serves the probes."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.generation_limiter(g))

    async def _close(self, g, jobs) -> None:
        """Close jobs (admission slots, leases, the model servers' sessions) in a worker thread,
        to the end even if the caller is being cancelled."""
        if jobs:
            with anyio.CancelScope(shield=True):
                await self._work(g, lambda: [job.close() for job in jobs])

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/vocab", self.vocab, methods=["GET"]),
            Route("/v1/sessions", self.create_session, methods=["POST"]),
            Route("/v1/sessions/{sid}", self.get_session, methods=["GET"]),
            Route("/v1/sessions/{sid}", self.delete_session, methods=["DELETE"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
        ]

    # ---- completions ------------------------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._generate(request, chat=True)

    async def _start_job(self, g, data: dict, chat: bool, request: Request):
        """Validate the body, take an admission slot and start the generation job (raises
        InvalidArgument, ResourceExhausted & co.)."""
        field = "messages" if chat else "prompt"
        opts, extra = split_body(data, field)
        if field not in extra:
            raise InvalidArgument(field, "is required")
        value = extra[field]
        if not chat and not isinstance(value, str):
            raise InvalidArgument("prompt", "must be a string")
        names = dict(option_names(data), prompt="prompt", messages="messages")
        names["top_logprobs"] = "top_logprobs" if chat else "logprobs"
        n = extra["n"]
        # greedy: the n completions are one and the same -- computed once, sent n times
        greedy = opts.get("temperature", g.cfg.default_temperature) == 0
        runs = 1 if greedy else n
        g.precheck(session_id=extra.get("session_id"), messages=value if chat else None, options=opts, names=names,
                   stop=extra.get("stop"), prompt=None if chat else value)
        jobs = []
        try:
            for i in range(runs):
                o = dict(opts)
                if i and "seed" in o:  # completion i > 0: its own seed, derived from the request's
                    o["seed"] = derive_seed(o["seed"], i)
                await g.admission.enter_async()
                start = functools.partial(
                    g.start, session_id=extra.get("session_id"), prompt=None if chat else value,
                    messages=value if chat else None, options=o, api="rest", names=names, stop=extra.get("stop"),
                    admitted=True, owner=key_owner(g.cfg, request.headers.get("authorization")),
                    top_logprobs=extra["top"], like=jobs[0] if jobs else None)
                # start() reads the session from Redis, tokenizes and places the job: in a worker
                # thread; shielded, so that a job it started is in `jobs` (closed below) even when
                # the client goes away meanwhile
                with anyio.CancelScope(shield=True):
                    job = await self._work(g, start)
                    job.echo = value if extra.get("echo") else ""  # completions: the prompt comes first in the text
                    jobs.append(job)
            if len(jobs) > 1:  # the n completions share the prompt's prefill
                await self._work(g, g.share_prefill, jobs)
        except BaseException:
            await self._close(g, jobs)
            raise
        include_usage = bool((extra.get("stream_options") or {}).get("include_usage"))
        return Completions(jobs, n), bool(extra.get("stream")), include_usage

    async def _stream(self, g, request: Request, jobs: Completions, events):
        """The streamed response, begun once its first chunk is ready: a request that fails before then
        (no verifier, no KV memory, ...) answers with its HTTP status (and Retry-After), as unstreamed
        requests do, rather than 200 and an error event. A client that leaves meanwhile cancels the jobs."""
        limiter = self.generation_limiter(g)
        head = failed = None
        async with anyio.create_task_group() as tg:  # errors caught inside: a task group would wrap them
            tg.start_soon(_cancel_on_disconnect, request, jobs)
            try:
                head = await anyio.to_thread.run_sync(next, events, None, limiter=limiter)
            except Exception as e:  # raised by sse_events only before its first chunk; it has closed the jobs
                failed = e
            tg.cancel_scope.cancel()
        if failed is not None:
            return error_response(failed)
        return ClosingStreamingResponse(_after(head, events), limiter=limiter, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _generate(self, request: Request, chat: bool):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        span = self.tracer.start_span(f"POST {route}", kind=trace.SpanKind.SERVER)
        ctx = trace.set_span_in_context(span)
        g = None
        try:
            g = self.gw()
            job, stream, include_usage = await self._start_job(g, await json_body(request), chat, request)
            jobs = job
        except Exception as e:
            if g is not None:
                why = "overloaded" if isinstance(e, ResourceExhausted) else "rejected"
                g.metrics.requests.labels("rest", why).inc()
            span.record_exception(e)
            span.end()
            return error_response(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if stream:
            return await self._stream(g, request, jobs, sse_events(jobs, ctx, span, rid, created, g.model_name, chat,
                                                                   include_usage, g.pair))

        outs: list[dict] = [{} for _ in jobs.jobs]

        def run_one(i):  # errors are kept, not raised: a task group would wrap them in an ExceptionGroup
            try:
                outs[i]["events"] = list(jobs.jobs[i].events(ctx))
            except Exception as e:
                outs[i]["error"] = e

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_cancel_on_disconnect, request, jobs)
                async with anyio.create_task_group() as runs:  # the n completions run side by side
                    for i in range(len(jobs.jobs)):
                        runs.start_soon(self._work, g, run_one, i)
                tg.cancel_scope.cancel()  # done: stop watching
        finally:
            span.end()
        errors = [o["error"] for o in outs if "error" in o]
        if errors:
            return error_response(errors[0])
        dones = []
        for job, o in zip(jobs.jobs, outs, strict=True):
            events = o.get("events")
            if job.cancelled or not events or events[-1]["type"] != "done":
                return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
            done = events[-1]
            if job.echo:
                done = dict(done, text=job.echo + done["text"])
            dones.append(done)
        dones = [dones[i % len(dones)] for i in range(jobs.n)]  # greedy: one run, n copies
        return JSONResponse(completions_json(dones, rid, created, g.model_name, chat, g.pair))

    # ---- models and vocabulary ----------------------------------------------------------------
    async def models(self, request: Request):
        try:
            g = self.gw()
        except Exception as e:
            return error_response(e)
        d = {"id": g.model_name, "object": "model", "created": 0, "owned_by": "crossdraft",
             "drafter": g.drafter_model,
             # the Hub commits served ("" for catalog models and local paths)
             "revision": getattr(g, "model_revision", ""), "drafter_revision": getattr(g, "drafter_revision", "")}
        kinds = getattr(g, "kinds", {})
        if len(kinds) > 1:  # a pool of drafter kinds: each by name, in the gateway's order
            d["drafters"] = [{"name": k.name, "model": k.model, "revision": k.revision} for k in kinds.values()]
        return JSONResponse({"object": "list", "data": [d]})

    async def vocab(self, request: Request):
        try:
            g = self.gw()
        except Exception as e:
            return error_response(e)
        pair = g.pair
        if pair.mapping is None:
            return JSONResponse({"drafter": None, "message": "no drafter: target-only"})
        st = await anyio.to_thread.run_sync(pair.mapping.stats)  # a pass over both vocabularies
        st.update({"drafter_allowed_tli": int(pair.allowed.sum()), "drafter_allowed_text": int(pair.allowed_text.sum()),
                   "draft_vocab": pair.draft_vocab, "drafter_drafts_tli": int(pair.masks["tli"].sum()),
                   "drafter_drafts_text": int(pair.masks["text"].sum()),
                   "same_vocabulary": bool(pair.same_vocab), "target_vocab_size": pair.vt,
                   "drafter_vocab_size": pair.vd})
        return JSONResponse(json.loads(json.dumps(st, default=lambda o: o.item() if hasattr(o, "item") else str(o))))

    # ---- the target's tokenizer -----------------------------------------------------------------
    async def tokenize(self, request: Request):
        """{"prompt": str} or {"messages": [...]} -> the target's token ids (chat: with its template)."""
        try:
            g = self.gw()
            check_api_key(g.cfg, request.headers.get("authorization"))
            data = await json_body(request)
            unknown = set(data) - {"prompt", "messages", "model"}
            if unknown:
                raise InvalidArgument(sorted(unknown)[0], "unknown field")
            if ("prompt" in data) == ("messages" in data):
                raise InvalidArgument("prompt", "give exactly one of prompt or messages")
            if "prompt" in data:
                prompt = data["prompt"]
                if not isinstance(prompt, str):
                    raise InvalidArgument("prompt", "must be a string")
                if len(prompt) > g.cfg.max_prompt_chars:
                    raise InvalidArgument("prompt", f"is longer than {g.cfg.max_prompt_chars} characters")
                check_utf8("prompt", prompt)
                ids = await anyio.to_thread.run_sync(g.pair.encode_target, prompt) if prompt else []
            else:
                messages = validate_messages(data["messages"])
                if sum(len(m["content"]) for m in messages) > g.cfg.max_prompt_chars:
                    raise InvalidArgument("messages", f"are longer than {g.cfg.max_prompt_chars} characters")
                ids = (await anyio.to_thread.run_sync(g.pair.chat_ids, messages, g.model_name))[0]
        except Exception as e:
            return error_response(e)
        return JSONResponse({"tokens": [int(t) for t in ids], "count": len(ids),
                             "max_model_len": g.max_context or None})

    async def detokenize(self, request: Request):
        """{"tokens": [ids]} -> {"prompt": the target tokenizer's text}."""
        try:
            g = self.gw()
            check_api_key(g.cfg, request.headers.get("authorization"))
            data = await json_body(request)
            unknown = set(data) - {"tokens", "model"}
            if unknown:
                raise InvalidArgument(sorted(unknown)[0], "unknown field")
            ids = data.get("tokens")
            if not isinstance(ids, list):
                raise InvalidArgument("tokens", "must be a list of token ids")
            if len(ids) > MAX_DETOKENIZE:
                raise InvalidArgument("tokens", f"at most {MAX_DETOKENIZE} ids, got {len(ids)}")
            vt = g.pair.vt
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vt:
                    raise InvalidArgument(f"tokens[{i}]", f"must be a token id in [0, {vt}), got {t!r}")
            text = await anyio.to_thread.run_sync(g.pair.target_tok.decode, ids)
        except Exception as e:
            return error_response(e)
        return JSONResponse({"prompt": text})

    # ---- sessions (Redis: in worker threads) --------------------------------------------------------
    async def create_session(self, request: Request):
        try:
            g = self.gw()
            data = await json_body(request) if (await request.body()) else {}
            sid = data.pop("session_id", None)
            if sid is not None and not isinstance(sid, str):
                raise InvalidArgument("session_id", "must be a string")
            opts = {}
            for k, v in data.items():
                if k not in REST_OPTIONS:
                    raise InvalidArgument(k, "unknown field")
                take_option(opts, k, v)
            s = await anyio.to_thread.run_sync(functools.partial(
                g.create_session, opts, sid, names=option_names(data),
                owner=key_owner(g.cfg, request.headers.get("authorization"))))
            return JSONResponse(session_json(s), status_code=201)
        except Exception as e:
            return error_response(e)

    async def get_session(self, request: Request):
        try:
            g = self.gw()
            owner = key_owner(g.cfg, request.headers.get("authorization"))
            s = await anyio.to_thread.run_sync(g.get_session, request.path_params["sid"], owner)
            return JSONResponse(session_json(s))
        except Exception as e:
            return error_response(e)

    async def delete_session(self, request: Request):
        try:
            g = self.gw()
            owner = key_owner(g.cfg, request.headers.get("authorization"))
            existed = await anyio.to_thread.run_sync(g.delete_session, request.path_params["sid"], owner)
            if not existed:
                raise NotFound("session_id", f"no session {request.path_params['sid']!r}")
            return JSONResponse({"session_id": request.path_params["sid"], "deleted": True})
        except Exception as e:
            return error_response(e)

    # ---- health and metrics ---------------------------------------------------------------------
    async def healthz(self, request: Request):
        """Liveness: the process answers -- unless its pairing went stale (every verifier serves
        another revision, Gateway.stale_pairing): then 503, so that the orchestrator restarts it.

        stale_pairing() reads what the last readiness check published, takes no lock and calls
        nothing remote; it runs in a thread of this probe's own limiter, so that the answer waits
        for no generation work."""
        g = self.gw_ref()
        if g is not None and g.cfg.stale_pairing_restart_s > 0:
            why = await anyio.to_thread.run_sync(g.stale_pairing, limiter=self._liveness)
            if why:
                return JSONResponse({"status": "stale pairing", "reason": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def readyz(self, request: Request):
        """Readiness: Redis answers (asked now) and every verifier reported SERVING at the gateway's
        last readiness check, at most READY_MAX_AGE_S old (the gateway's readiness thread repeats it
        every second; an older one is repeated here). The model servers' answers are taken from
        that check because asking them costs several RPCs, each slow when the gateway is busy;
        Redis is asked afresh, so that a lost Redis turns the answer to 503 at once. Runs in a
        thread of this probe's own limiter, never behind generation work."""
        g = self.gw_ref()
        if g is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        ok, details = await anyio.to_thread.run_sync(_readiness, g, limiter=self._readiness)
        if not ok:
            why = ("Redis is unreachable" if details.get("redis") != "ok"
                   else "a verifier is not serving (starting, loading its model, or down)")
            return JSONResponse({"status": "unavailable", "reason": why, **details}, status_code=503)
        return JSONResponse({"status": "ready", **details})

    async def openapi(self, request: Request):
        from .openapi import openapi_document

        g = self.gw_ref()
        return JSONResponse(openapi_document(g.cfg.max_new_tokens_limit if g is not None else 4096))

    async def metrics(self, request: Request):
        g = self.gw_ref()
        if g is None:
            return Response("", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(g.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def build_app(gw_ref, tracer=None):
    """The ASGI app: gw_ref() is the Gateway, or None while it is starting (readyz then says 503)."""
    app = Starlette(routes=RestApi(gw_ref, tracer).routes(), exception_handlers={HTTPException: http_error})
    return _ApiKeyMiddleware(app, gw_ref)


class _ApiKeyMiddleware:
    """With API keys configured, /v1/* needs "Authorization: Bearer <key>" (health and metrics do not)."""

    def __init__(self, app, gw_ref):
        self.app = app
        self.gw_ref = gw_ref

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            g = self.gw_ref()
            if g is not None and g.cfg.api_keys:
                auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
                try:
                    check_api_key(g.cfg, auth)
                except Unauthenticated as e:
                    g.metrics.requests.labels("rest", "unauthenticated").inc()
                    await error_response(e)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


__all__ = ["RestApi", "build_app"]
