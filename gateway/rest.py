"""REST front end (OpenAI-compatible): /v1/completions, /v1/chat/completions (SSE with
"stream": true), /v1/models, /v1/vocab, /v1/sessions, /healthz, /readyz, /metrics."""

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
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from crossdraft.errors import (
    CrossdraftError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    check_int,
)

from .core import OPTION_FIELDS, add_stats, check_api_key, check_utf8, key_owner, validate_messages

MAX_BODY_BYTES = 4 << 20
# Worker threads per kind of work (anyio limiters). The rounds of a generation block a thread for as
# long as they run; on a limiter shared with the probes (anyio's default one has 40 threads) a busy
# gateway would make /healthz and /readyz wait until some generation ends. So generation work has a
# limiter sized by the admission limit (admission, not the thread count, bounds the generations), each
# probe one of its own, and the rest (sessions, tokenizer) anyio's default one.
PROBE_THREADS = 2  # per probe endpoint: probes that arrive while two run wait for those, not for work
GENERATION_THREADS_EXTRA = 8  # beyond one per admitted generation: a closing stream, a shared prefill
MAX_DETOKENIZE = 1 << 20  # token ids per /detokenize call
RETRY_AFTER_S = 1  # 429 / 503: when to try again (a round or two frees KV memory; a restart takes longer)
# REST field -> gateway option
REST_OPTIONS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "temperature": "temperature",
                "top_k": "top_k", "top_p": "top_p", "repetition_penalty": "repetition_penalty", "seed": "seed",
                "num_draft_tokens": "num_draft_tokens", "adaptive_draft": "adaptive_draft",
                "use_drafter": "use_drafter"}
# accepted for compatibility; only their neutral values are allowed
MAX_N = 16  # completions per request (`n`)
NEUTRAL = {"presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
           "best_of": (1,), "user": None, "model": None,
           "suffix": (None, "")}


def error_response(exc: Exception) -> JSONResponse:
    status, etype, param = 500, "server_error", None
    msg = str(exc)
    if isinstance(exc, InvalidArgument):
        status, etype, param = 400, "invalid_request_error", exc.field
        if "longer than" in msg:
            status = 413
    elif isinstance(exc, NotFound):
        status, etype, param = 404, "not_found_error", exc.what
    elif isinstance(exc, FailedPrecondition):
        status, etype = 409, "conflict_error"
        head, sep, _ = msg.partition(": ")
        param = head if sep and head.isidentifier() else None  # e.g. "session_id: session 'x' already exists"
    elif isinstance(exc, ResourceExhausted):
        status, etype = 429, "rate_limit_error"
    elif isinstance(exc, Unavailable):
        status, etype = 503, "service_unavailable"
    elif isinstance(exc, Unauthenticated):
        status, etype, param = 401, "authentication_error", "authorization"
    elif not isinstance(exc, CrossdraftError):
        msg = f"internal error ({type(exc).__name__})"
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse({"error": {"message": msg, "type": etype, "param": param, "code": status}}, status_code=status,
                        headers=headers)


async def _json_body(request: Request) -> dict:
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise InvalidArgument("body", f"is longer than {MAX_BODY_BYTES} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument("body", f"is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument("body", f"is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # e.g. "[[[[..." 100k deep: json.loads overflows the stack
        raise InvalidArgument("body", "is nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidArgument("body", "must be a JSON object")
    return data


def _take_option(opts: dict, name: str, value) -> None:
    """Record REST field `name` as its gateway option (max_tokens and max_completion_tokens are one)."""
    if REST_OPTIONS[name] in opts:
        raise InvalidArgument(name, "give only one of max_tokens or max_completion_tokens")
    opts[REST_OPTIONS[name]] = value


def _split(data: dict, input_field: str) -> tuple[dict, dict]:
    """A completion request's body -> (gateway options, other fields: input, stream, session_id)."""
    opts, extra = {}, {}
    for k, v in data.items():
        if k in REST_OPTIONS:
            _take_option(opts, k, v)
        elif k in (input_field, "stream", "session_id", "stop", "stream_options", "echo", "logprobs", "top_logprobs",
                   "n"):
            extra[k] = v
        elif k in NEUTRAL:
            allowed = NEUTRAL[k]
            if allowed is not None and v not in allowed:
                raise InvalidArgument(k, f"is not supported (only {allowed[0]!r})")
        else:
            raise InvalidArgument(k, "unknown field")
    if "stream" in extra and not isinstance(extra["stream"], bool):
        raise InvalidArgument("stream", "must be a boolean")
    sid = extra.get("session_id")
    if sid is not None and not isinstance(sid, str):
        raise InvalidArgument("session_id", "must be a string")
    extra["top"] = _top_logprobs(extra, chat=input_field == "messages")
    extra["n"] = check_int("n", extra.get("n", 1), 1, MAX_N)
    if extra["n"] > 1 and sid is not None:
        raise InvalidArgument("n", "must be 1 for a request on a session (one history, one continuation)")
    if "echo" in extra:
        if not isinstance(extra["echo"], bool):
            raise InvalidArgument("echo", "must be a boolean")
        if extra["echo"] and input_field == "messages":
            raise InvalidArgument("echo", "is for /v1/completions only")
    so = extra.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidArgument("stream_options", "must be an object")
        for k, v in so.items():
            if k != "include_usage":
                raise InvalidArgument(f"stream_options.{k}", "unknown field")
            if not isinstance(v, bool):
                raise InvalidArgument("stream_options.include_usage", "must be a boolean")
        if not extra.get("stream"):
            raise InvalidArgument("stream_options", "is only allowed with stream: true")
    return opts, extra


def _top_logprobs(extra: dict, chat: bool) -> int:
    """-1 (no log-probabilities) or how many alternatives per token: completions take
    ``logprobs: N`` (0-20), chat ``logprobs: true`` with ``top_logprobs: N``."""
    lp, top = extra.get("logprobs"), extra.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise InvalidArgument("logprobs", "must be a boolean (chat); use top_logprobs for how many alternatives")
        if top is not None:
            if not lp:
                raise InvalidArgument("top_logprobs", "needs logprobs: true")
            return check_int("top_logprobs", top, 0, 20)
        return 0 if lp else -1
    if top is not None:
        raise InvalidArgument("top_logprobs", "is for chat; completions take logprobs: N")
    if lp is None or lp is False:
        return -1
    return check_int("logprobs", lp, 0, 20)


def _token_text(pair, tid: int) -> tuple[str, list[int]]:
    b = pair.target_text_bytes([tid])
    return b.decode("utf-8", errors="replace"), list(b)


def _logprobs_json(pair, token_ids, lps, chat: bool, offset: int = 0):
    """OpenAI's logprobs object for these tokens (None when none were asked for)."""
    if lps is None:
        return None
    if chat:
        content = []
        for tid, (lp, ids, vals) in zip(token_ids, lps, strict=False):
            tok, raw = _token_text(pair, tid)
            tops = []
            for i, v in zip(ids, vals, strict=False):
                t, r = _token_text(pair, i)
                tops.append({"token": t, "logprob": v, "bytes": r})
            content.append({"token": tok, "logprob": lp, "bytes": raw, "top_logprobs": tops})
        return {"content": content}
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, (lp, ids, vals) in zip(token_ids, lps, strict=False):
        tok, _ = _token_text(pair, tid)
        tokens.append(tok)
        token_lps.append(lp)
        best: dict = {}
        for i, v in zip(ids, vals, strict=False):  # best first: ids with the same text keep the best
            best.setdefault(_token_text(pair, i)[0], v)
        tops.append(best)
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


NAMES = {v: k for k, v in REST_OPTIONS.items() if k != "max_completion_tokens"}


def _names(data: dict) -> dict:
    """Option -> REST field names for errors, naming max_completion_tokens when that is what was sent."""
    return dict(NAMES, max_new_tokens="max_completion_tokens") if "max_completion_tokens" in data else NAMES


def _session_json(s) -> dict:
    return {"session_id": s.session_id, "turns": s.turns, "target_tokens": len(s.target_ids),
            "drafter_tokens": len(s.drafter_ids), "options": {NAMES.get(k, k): v for k, v in s.options.items()},
            "stats": s.stats, "drafter_instance": s.drafter_instance, "verifier_instance": s.verifier_instance,
            "drafter_address": s.drafter_address, "verifier_address": s.verifier_address,
            "created": s.created_unix_s, "updated": s.updated_unix_s, "messages": s.messages, "text": s.text}


def _final(done: dict, rid: str, created: int, model: str, chat: bool, pair=None) -> dict:
    """The whole (non-streamed) completion in the OpenAI response shape."""
    lps = _logprobs_json(pair, done.get("token_ids", []), done.get("logprobs"), chat) if pair is not None else None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": done["text"]},
                  "finish_reason": done["finish_reason"]}
        if lps is not None:
            choice["logprobs"] = lps
    else:
        choice = {"index": 0, "text": done["text"], "finish_reason": done["finish_reason"], "logprobs": lps}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": done["usage"], "speculative": done["stats"],
            "session_id": done["session_id"] or None}


def derive_seed(seed: int, i: int) -> int:
    """The seed of completion i > 0 of a request with ``n`` > 1: a function of the request's seed."""
    import hashlib

    h = hashlib.blake2b(f"crossdraft-n:{seed}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & (2**63 - 1)


class Completions:
    """The jobs of one request: ``n`` completions from ``len(jobs)`` runs (1 run for greedy)."""

    def __init__(self, jobs: list, n: int):
        self.jobs, self.n = jobs, n

    def cancel(self) -> None:
        for j in self.jobs:
            j.cancel()

    def close(self) -> None:
        for j in self.jobs:
            j.close()


def _final_many(dones: list[dict], rid: str, created: int, model: str, chat: bool, pair=None) -> dict:
    """n completions in one response: a choice each; usage counts the prompt once and every choice's
    tokens; ``speculative`` sums the stats of the runs that computed them."""
    out = _final(dones[0], rid, created, model, chat, pair)
    if len(dones) == 1:
        return out
    out["choices"] = [dict(_final(d, rid, created, model, chat, pair)["choices"][0], index=i)
                      for i, d in enumerate(dones)]
    completion = sum(d["usage"]["completion_tokens"] for d in dones)
    prompt = dones[0]["usage"]["prompt_tokens"]
    out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    total: dict = {}
    for d in {id(d): d for d in dones}.values():  # greedy: one run sent n times counts once
        total = add_stats(total, d["stats"])
    out["speculative"] = dict(out["speculative"], **total)
    return out


def _merged(jobs: "Completions", ctx):
    """(choice index, event) from every job: one job is read directly; several run in threads, their
    events interleaved as they come. Greedy n > 1 (one run): each event goes to every index."""
    import queue
    import threading

    runs, n = jobs.jobs, jobs.n
    if len(runs) == 1:
        events = runs[0].events(ctx)
        try:
            for ev in events:
                for i in range(n):
                    yield i, ev
        finally:
            events.close()
        return
    q: queue.Queue = queue.Queue()

    def pump(i, job):
        events = job.events(ctx)
        try:
            for ev in events:
                q.put((i, ev, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader
            q.put((i, None, e))
        finally:
            events.close()
            q.put((i, None, None))

    threads = [threading.Thread(target=pump, args=(i, j), daemon=True) for i, j in enumerate(runs)]
    for t in threads:
        t.start()
    live = len(runs)
    try:
        while live:
            i, ev, err = q.get()
            if err is not None:
                raise err
            if ev is None:
                live -= 1
                continue
            yield i, ev
    finally:
        if live:  # the reader went away early: the others stop after their round in flight
            jobs.cancel()


def _sse(jobs: Completions, ctx, span, rid: str, created: int, model: str, chat: bool, include_usage: bool = False,
         pair=None):
    """The completion(s) as server-sent events (OpenAI chunk shapes), then ``data: [DONE]``.

    Each choice's finishing chunk carries its ``usage`` (and speculative stats); with
    ``stream_options.include_usage`` one more chunk follows with no choices and the request's
    usage (the prompt once, every choice's tokens), as OpenAI clients expect."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = jobs.n
    offset = [0] * n  # completions: text_offset of each choice's next token

    def chunk(delta_text, finish=None, extra=None, first=False, ev=None, index=0):
        lps = None
        if ev is not None and ev.get("logprobs") is not None and pair is not None:
            lps = _logprobs_json(pair, ev["token_ids"], ev["logprobs"], chat, offset[index])
            if not chat and lps["tokens"]:
                offset[index] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        if chat:
            delta = {"content": delta_text} if delta_text or not first else {"role": "assistant", "content": ""}
            if first and delta_text:
                delta = {"role": "assistant", "content": delta_text}
            c = {"index": index, "delta": delta if finish is None else {}, "finish_reason": finish}
            if lps is not None:
                c["logprobs"] = lps
        else:
            c = {"index": index, "text": delta_text, "finish_reason": finish, "logprobs": lps}
        d = {"id": rid, "object": obj, "created": created, "model": model, "choices": [c]}
        if extra:
            d.update(extra)
        return f"data: {json.dumps(d)}\n\n"

    # held here (not only by the loop), so that when the client goes away the jobs are marked
    # cancelled before their generators are closed
    events = _merged(jobs, ctx)
    try:
        first = [True] * n
        echo = getattr(jobs.jobs[0], "echo", "")
        if echo:
            for i in range(n):
                yield chunk(echo, first=True, index=i)
                first[i] = False
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, ev in events:
            if ev["type"] == "delta":
                # a delta with tokens but no text yet (held back, or part of a character) still
                # goes out when its tokens' log-probabilities were asked for
                if ev["text"] or first[i] or ev.get("logprobs"):
                    yield chunk(ev["text"], first=first[i], ev=ev, index=i)
                    first[i] = False
            else:
                yield chunk("", finish=ev["finish_reason"], index=i,
                            extra={"usage": ev["usage"], "speculative": ev["stats"],
                                   "session_id": ev["session_id"] or None})
                usage["prompt_tokens"] = ev["usage"]["prompt_tokens"]
                usage["completion_tokens"] += ev["usage"]["completion_tokens"]
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if include_usage:
            yield "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model,
                                         "choices": [], "usage": usage}) + "\n\n"
        yield "data: [DONE]\n\n"
    except GeneratorExit:  # the client went away (Starlette stops reading us): no more rounds
        jobs.cancel()
        raise
    except Exception as e:
        err = json.loads(error_response(e).body)
        yield f"data: {json.dumps(err)}\n\n"
    finally:
        events.close()
        jobs.close()
        span.end()


_END = object()
READY_MAX_AGE_S = 2.0  # /readyz: the oldest readiness check of the model servers it answers from


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


async def _in_threads_then_close(gen, limiter=None):
    """Iterate a sync generator in worker threads of `limiter` (as Starlette does with one) and,
    however the iteration ends (done, an error, the task cancelled), close it in a worker thread at once."""
    try:
        while True:
            item = await anyio.to_thread.run_sync(next, gen, _END, limiter=limiter)
            if item is _END:
                return
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(gen.close, limiter=limiter)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse over a sync generator that is closed as soon as the response ends,
    also when the client goes away.

    Starlette's own StreamingResponse never closes the generator of a client that disconnects:
    it is left to the garbage collector, whose finalizers run in whatever thread happens to trigger
    a collection, at any point of its code. The generator's cleanup (cancel the jobs, give back
    the admission slot and the placement counts, end the one-off sessions on the model servers)
    then ran inside unrelated code -- once inside ``Placement.choose`` on the event loop, while it
    held the placement lock that the cleanup takes again: the gateway deadlocked (found by
    benchmarks/soak.py). Here the cleanup runs in a worker thread before the response returns."""

    def __init__(self, content, limiter=None, **kw):
        super().__init__(_in_threads_then_close(iter(content), limiter), **kw)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def _http_error(request: Request, exc: HTTPException):
    # unknown paths (404) and wrong methods (405) answer in the same JSON error shape as the rest
    etype = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    msg = f"{exc.detail}: {request.method} {request.url.path}"
    return JSONResponse({"error": {"message": msg, "type": etype, "param": None, "code": exc.status_code}},
                        status_code=exc.status_code, headers=exc.headers)


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
        opts, extra = _split(data, field)
        if field not in extra:
            raise InvalidArgument(field, "is required")
        value = extra[field]
        if not chat and not isinstance(value, str):
            raise InvalidArgument("prompt", "must be a string")
        names = dict(_names(data), prompt="prompt", messages="messages")
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

    async def _generate(self, request: Request, chat: bool):
        route = "/v1/chat/completions" if chat else "/v1/completions"
        span = self.tracer.start_span(f"POST {route}", kind=trace.SpanKind.SERVER)
        ctx = trace.set_span_in_context(span)
        g = None
        try:
            g = self.gw()
            job, stream, include_usage = await self._start_job(g, await _json_body(request), chat, request)
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
            return ClosingStreamingResponse(_sse(jobs, ctx, span, rid, created, g.model_name, chat, include_usage,
                                                 g.pair), limiter=self.generation_limiter(g),
                                            media_type="text/event-stream",
                                            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        outs: list[dict] = [{} for _ in jobs.jobs]

        def run_one(i):  # errors are kept, not raised: a task group would wrap them in an ExceptionGroup
            try:
                outs[i]["events"] = list(jobs.jobs[i].events(ctx))
            except Exception as e:
                outs[i]["error"] = e

        async def watch_disconnect():
            # the body is read: the next message is the disconnect, if the client leaves
            while (await request.receive())["type"] != "http.disconnect":
                pass
            jobs.cancel()  # the rounds stop after the one in flight

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnect)
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
        return JSONResponse(_final_many(dones, rid, created, g.model_name, chat, g.pair))

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
            data = await _json_body(request)
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
            data = await _json_body(request)
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
            data = await _json_body(request) if (await request.body()) else {}
            sid = data.pop("session_id", None)
            if sid is not None and not isinstance(sid, str):
                raise InvalidArgument("session_id", "must be a string")
            opts = {}
            for k, v in data.items():
                if k not in REST_OPTIONS:
                    raise InvalidArgument(k, "unknown field")
                _take_option(opts, k, v)
            s = await anyio.to_thread.run_sync(functools.partial(
                g.create_session, opts, sid, names=_names(data),
                owner=key_owner(g.cfg, request.headers.get("authorization"))))
            return JSONResponse(_session_json(s), status_code=201)
        except Exception as e:
            return error_response(e)

    async def get_session(self, request: Request):
        try:
            g = self.gw()
            owner = key_owner(g.cfg, request.headers.get("authorization"))
            s = await anyio.to_thread.run_sync(g.get_session, request.path_params["sid"], owner)
            return JSONResponse(_session_json(s))
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
    app = Starlette(routes=RestApi(gw_ref, tracer).routes(), exception_handlers={HTTPException: _http_error})
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


__all__ = ["OPTION_FIELDS", "RestApi", "build_app"]
