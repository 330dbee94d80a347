"""Streaming the REST completions: the events of a request's runs merged into one stream, written
as server-sent events in OpenAI's chunk shapes, and a streaming response that closes its generator
(and so the request's jobs) as soon as the response ends."""

from __future__ import annotations

import itertools
import json
import queue
import threading

import anyio
from starlette.responses import StreamingResponse

from .rest_errors import error_response
from .rest_json import logprobs_json

_END = object()


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


def merged_events(jobs: Completions, ctx):
    """(choice index, event) from every job: one job is read directly; several run in threads, their
    events interleaved as they come. Greedy n > 1 (one run): each event goes to every index."""
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


def sse_events(jobs: Completions, ctx, span, rid: str, created: int, model: str, chat: bool,
               include_usage: bool = False, pair=None):
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
            lps = logprobs_json(pair, ev["token_ids"], ev["logprobs"], chat, offset[index])
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
    events = merged_events(jobs, ctx)
    sent = False  # an error before anything is sent is raised, to answer with its HTTP status
    try:
        head = list(itertools.islice(events, 1))  # the first round runs before the first byte goes out
        first = [True] * n
        echo = getattr(jobs.jobs[0], "echo", "")
        if echo:
            for i in range(n):
                sent = True
                yield chunk(echo, first=True, index=i)
                first[i] = False
        usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, ev in itertools.chain(head, events):
            sent = True
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
        if not sent:
            span.record_exception(e)
            raise
        err = json.loads(error_response(e).body)
        yield f"data: {json.dumps(err)}\n\n"
    finally:
        events.close()
        jobs.close()
        span.end()


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
    would then run inside unrelated code -- inside ``Placement.choose`` on the event loop, say,
    which holds the placement lock that the cleanup takes again: a deadlock. Here the cleanup runs
    in a worker thread before the response returns."""

    def __init__(self, content, limiter=None, **kw):
        super().__init__(_in_threads_then_close(iter(content), limiter), **kw)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
