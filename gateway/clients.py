"""gRPC clients of the drafter and verifier services, shaped as the round loop's ports.

They have the signatures of :class:`crossdraft.runtime.workers.DrafterWorker` / ``VerifierWorker`` so that
:class:`crossdraft.decoding.decode.Decoder` runs the same code in process and here. gRPC failures become
core errors: NOT_FOUND -> NotFound and FAILED_PRECONDITION -> FailedPrecondition (the loop
re-syncs), INVALID_ARGUMENT -> InvalidArgument, RESOURCE_EXHAUSTED -> ResourceExhausted (a model
server's KV pool is full of busy sessions: HTTP 429), anything else -> Unavailable.
"""

from __future__ import annotations

import logging
import threading

import grpc
import numpy as np
from opentelemetry import trace

from crossdraft.decoding.messages import DraftToken, VerifyReply
from crossdraft.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from crossdraft.serving import rpc, wire
from crossdraft.serving.tls import FileWatch
from crossdraft.v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

log = logging.getLogger("crossdraft.gateway")
ROTATION_GRACE_S = 120.0  # a replaced channel stays open this long for the calls still on it


class Unimplemented(Unavailable):
    """The server does not have the RPC (an older version): UNIMPLEMENTED."""


def _convert(e: grpc.RpcError, who: str, addr: str) -> Exception:
    """Map a gRPC error from `who` at `addr` to the crossdraft error of its status code."""
    code = e.code() if hasattr(e, "code") else None
    msg = e.details() if hasattr(e, "details") else str(e)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound("session_id", f"{who} {addr}: {msg}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPrecondition(f"{who} {addr}: {msg}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{who} {addr}: {msg}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, rest = (msg or "").partition(": ")
        return InvalidArgument(field or who, rest or msg)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unimplemented(f"{who} {addr} UNIMPLEMENTED: {msg}")
    return Unavailable(f"{who} {addr} {code.name if code else 'error'}: {msg}")


class _Remote:
    """What both clients share: the channel, one client span per RPC, errors converted, ModelInfo cached."""

    who = "server"

    stub_class = None  # the service's generated stub

    def __init__(self, address: str, tracer=None, timeout_s: float = 60.0, tls=None):
        """tls: a crossdraft.serving.tls.TLSConfig (the servers' CA, this client's certificate) or None."""
        self.address = address
        self.tls = tls if tls is not None and tls.enabled else None
        self.channel = rpc.client_channel(address, tls=self.tls)
        self.stub = self.stub_class(self.channel)
        self._watch = FileWatch(self.tls.files()) if self.tls else None
        self.tracer = tracer or trace.get_tracer("crossdraft.gateway")
        self.timeout_s = timeout_s
        self._info = None
        self._lock = threading.Lock()

    def _rotate(self) -> None:
        """Certificate files changed (a rotated Secret): new calls use a new channel; the old one is
        closed after a grace period, so calls in flight on it finish."""
        if self._watch is None or not self._watch.changed():
            return
        try:
            self.tls.check_client()  # a certificate replaced before its key: wait for the pair
            channel = rpc.client_channel(self.address, tls=self.tls)
        except Exception as e:  # half-written files: keep the current channel, look again next call
            self._watch.forget()
            log.warning("TLS files changed but cannot be loaded (keeping the old channel): %s", e)
            return
        old, self.channel, self.stub = self.channel, channel, self.stub_class(channel)
        t = threading.Timer(ROTATION_GRACE_S, old.close)
        t.daemon = True
        t.start()
        log.info("TLS files changed: new channel to %s %s", self.who, self.address)

    def _call(self, name: str, fn, req, timeout_s=None):
        """Run one unary RPC inside a client span; gRPC errors are raised as crossdraft errors."""
        if self._watch is not None:
            self._rotate()
            fn = getattr(self.stub, name)  # the stub of the current channel
        with self.tracer.start_as_current_span(f"{self.service}/{name}", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("net.peer.name", self.address)
            try:
                return fn(req, timeout=timeout_s or self.timeout_s, metadata=rpc.traced_metadata())
            except grpc.RpcError as e:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e.code())))
                raise _convert(e, self.who, self.address) from None

    def info(self, refresh: bool = False) -> dict:
        """The server's ModelInfo as a dict, fetched once and cached (refresh=True fetches it again)."""
        if self._info is None or refresh:
            self._info = self._fetch_info()
        return self._info

    @property
    def instance_id(self) -> str:
        return self.info().get("instance_id", "")

    def cost(self, head_rows: int | None = None) -> tuple[int, int, int]:
        """(body_bytes, head_row_bytes, head_rows) of one token's forward, from the server's ModelInfo."""
        i = self.info()
        return int(i["body_bytes"]), int(i["head_row_bytes"]), int(i["vocab_size"] if head_rows is None else head_rows)

    def timings(self) -> list[float]:
        """The server's measured ms of one forward of 1..M tokens, from its ModelInfo ([] when off)."""
        return list(self.info().get("forward_ms", []))

    def close(self) -> None:
        self.channel.close()


class RemoteVerifier(_Remote):
    """gRPC client of a verifier service (crossdraft.v1.VerifierService), usable as a VerifierPort."""

    who = "verifier"
    service = "crossdraft.v1.VerifierService"
    stub_class = verifier_pb2_grpc.VerifierServiceStub

    def __init__(self, address, tracer=None, timeout_s: float = 120.0, tls=None):
        super().__init__(address, tracer, timeout_s, tls)

    def _fetch_info(self) -> dict:
        r = self._call("GetVerifierInfo", self.stub.GetVerifierInfo, verifier_pb2.GetVerifierInfoRequest(), 10)
        return wire.model_info_from_proto(r.info)

    def tokenizer_files(self) -> tuple[dict[str, bytes], str]:
        """The verifier model's tokenizer files (name -> bytes) and their digest."""
        r = self._call("GetVerifierTokenizer", self.stub.GetVerifierTokenizer,
                       verifier_pb2.GetVerifierTokenizerRequest(), 60)
        return {f.name: f.content for f in r.files}, r.tokenizer_digest

    def sync(self, sid, ids, prefill: bool = False):
        """Create or align session `sid` on the verifier with the full history; (reused entries, state)."""
        r = self._call("SyncVerifierSession", self.stub.SyncVerifierSession,
                       verifier_pb2.SyncVerifierSessionRequest(session_id=sid, token_ids=ids, prefill=prefill))
        return r.reused_tokens, wire.expect_from_proto(r.context)

    def fork(self, src, dst):
        """Session `dst` on the verifier starts as a copy of `src` (cache shared); (shared entries, state)."""
        r = self._call("ForkVerifierSession", self.stub.ForkVerifierSession,
                       verifier_pb2.ForkVerifierSessionRequest(source_session_id=src, session_id=dst))
        return r.shared_tokens, wire.expect_from_proto(r.context)

    def verify(self, sid, expect, drafts, q_rows, round_index, params, seed, top_logprobs: int = -1,
               drop_last: bool = False, gang: int = 0) -> VerifyReply:
        """Verify the drafts on the verifier (one forward, lossless acceptance); see VerifierPort.verify."""
        req = verifier_pb2.VerifyRequest(session_id=sid, draft_token_ids=drafts, round_index=round_index,
                                         params=wire.params_to_proto(params), seed=seed, drop_last_token=drop_last,
                                         gang=gang)
        if top_logprobs >= 0:
            req.top_logprobs = top_logprobs
        if expect is not None:
            req.expect.CopyFrom(wire.expect_to_proto(expect))
        if q_rows:
            for ids, probs in q_rows:
                req.q.append(wire.sparse_to_proto(ids, probs))
        r = self._call("Verify", self.stub.Verify, req)
        return VerifyReply(r.num_accepted, r.next_token_id, list(r.accepted), r.forward_ms / 1e3,
                           wire.expect_from_proto(r.context), batch_size=r.batch_size or 1,
                           queue_wait_s=r.queue_wait_ms / 1e3, active_sessions=r.active_sessions or r.batch_size or 1,
                           logprobs=[(x.logprob, list(x.top_ids), list(x.top_logprobs)) for x in r.logprobs]
                           if top_logprobs >= 0 else None, price=wire.price_from_proto(r))

    def end(self, sid) -> bool:
        """Drop session `sid` on the verifier; whether it existed."""
        return self._call("EndVerifierSession", self.stub.EndVerifierSession,
                          verifier_pb2.EndVerifierSessionRequest(session_id=sid), 10).existed


class RemoteDrafter(_Remote):
    """gRPC client of a drafter service (crossdraft.v1.DrafterService), usable as a DrafterPort."""

    who = "drafter"
    service = "crossdraft.v1.DrafterService"
    stub_class = drafter_pb2_grpc.DrafterServiceStub

    def __init__(self, address, tracer=None, timeout_s: float = 30.0, tls=None):
        super().__init__(address, tracer, timeout_s, tls)
        self._price = None  # the drafter's latest published price of a batched step
        self._block = True  # the drafter answers DraftBlock (False once it said UNIMPLEMENTED: an older one)

    def price(self):
        """The drafter's price of a batched step, as its latest Draft stream ended with (None: none yet,
        or an unbatched or older drafter)."""
        return self._price

    def _fetch_info(self) -> dict:
        r = self._call("GetDrafterInfo", self.stub.GetDrafterInfo, drafter_pb2.GetDrafterInfoRequest(), 10)
        return wire.model_info_from_proto(r.info)

    def tokenizer_files(self) -> tuple[dict[str, bytes], str]:
        """The drafter model's tokenizer files (name -> bytes) and their digest."""
        r = self._call("GetDrafterTokenizer", self.stub.GetDrafterTokenizer,
                       drafter_pb2.GetDrafterTokenizerRequest(), 60)
        return {f.name: f.content for f in r.files}, r.tokenizer_digest

    def set_allowed(self, key, mask, target_ids=None) -> int:
        """Register the drafter-id mask under `key` (sent bit-packed) and, optionally, the target id of
        each allowed id (for coupled draws); returns how many ids it allows."""
        mask = np.asarray(mask, dtype=bool)
        tids = [] if target_ids is None else np.asarray(target_ids, dtype=np.int64).tolist()
        r = self._call("SetAllowedTokens", self.stub.SetAllowedTokens,
                       drafter_pb2.SetAllowedTokensRequest(allowed_key=key, vocab_size=len(mask),
                                                           mask=wire.pack_mask(mask), target_ids=tids))
        return r.allowed_count

    def sync(self, sid, ids, prefill: bool = False):
        """Create or align session `sid` on the drafter with the full history; (reused entries, state)."""
        r = self._call("SyncDrafterSession", self.stub.SyncDrafterSession,
                       drafter_pb2.SyncDrafterSessionRequest(session_id=sid, token_ids=ids, prefill=prefill))
        return r.reused_tokens, wire.expect_from_proto(r.context)

    def fork(self, src, dst):
        """Session `dst` on the drafter starts as a copy of `src` (cache shared); (shared entries, state)."""
        r = self._call("ForkDrafterSession", self.stub.ForkDrafterSession,
                       drafter_pb2.ForkDrafterSessionRequest(source_session_id=src, session_id=dst))
        return r.shared_tokens, wire.expect_from_proto(r.context)

    def draft(self, sid, edit, expect, k, round_index, params, seed, stop_below, allowed_key, timeout_s=None,
              stop_cumulative=0.0, heal=False, position=-1, cancel=None, runner_up=False, gang=0):
        """Apply the edit, then collect the up to k draft tokens the drafter streams back. cancel:
        ``is_set()`` is asked once after each token received (DrafterPort.draft); True cancels the stream
        there (the drafter stops that block: DrafterWorker.draft_iter)."""
        req = drafter_pb2.DraftRequest(session_id=sid, num_draft_tokens=k, round_index=round_index,
                                       params=wire.params_to_proto(params), seed=seed, stop_below=stop_below,
                                       allowed_key=allowed_key, stop_cumulative_below=stop_cumulative, heal=heal,
                                       position=max(0, position), runner_up=runner_up, gang=gang)
        if edit is not None:
            req.edit.keep = edit[0]
            req.edit.append.extend(edit[1])
        if expect is not None:
            req.expect.CopyFrom(wire.expect_to_proto(expect))
        if cancel is None and self._block:  # the caller waits for the whole block: one reply
            try:
                r = self._call("DraftBlock", self.stub.DraftBlock, req, timeout_s)
            except Unimplemented:  # an older drafter: its Draft stream
                self._block = False
            else:
                if r.HasField("done"):
                    self._price = wire.price_from_proto(r.done) or self._price
                return self._tokens(r.tokens, [])
        toks: list[DraftToken] = []
        self._rotate()
        with self.tracer.start_as_current_span(f"{self.service}/Draft", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("rpc.system", "grpc")
            span.set_attribute("net.peer.name", self.address)
            try:
                stream = self.stub.Draft(req, timeout=timeout_s or self.timeout_s, metadata=rpc.traced_metadata())
                for m in stream:
                    if m.HasField("token"):
                        self._tokens((m.token,), toks)
                    elif m.HasField("done"):
                        self._price = wire.price_from_proto(m.done) or self._price
                    if cancel is not None and cancel.is_set():
                        stream.cancel()
                        span.set_attribute("crossdraft.cancelled", True)
                        break
            except grpc.RpcError as e:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(e.code())))
                raise _convert(e, self.who, self.address) from None
            span.set_attribute("crossdraft.drafted", len(toks))
        return toks

    def _tokens(self, msgs, toks: list) -> list:
        """DraftToken messages appended to toks as DraftTokens (the last one's price kept); returns toks."""
        for t in msgs:
            q_ids = np.asarray(t.q_token_ids, dtype=np.int64) if len(t.q_token_ids) else None
            q_probs = np.asarray(t.q_probs, dtype=np.float32) if q_ids is not None else None
            toks.append(DraftToken(t.token_id, q_ids, q_probs, t.forward_ms / 1e3, t.last,
                                   heals=t.heals and not toks, queue_s=t.queue_wait_ms / 1e3, prob=t.prob,
                                   alt=t.runner_up_id if t.runner_up_prob > 0 else -1, alt_prob=t.runner_up_prob,
                                   batch_rows=t.batch_rows))
            if t.last:
                self._price = wire.price_from_proto(t) or self._price
        return toks

    def commit(self, sid, edit, expect):
        """Apply the edit to the drafter's session without drafting; returns its new state."""
        req = drafter_pb2.CommitRequest(session_id=sid)
        if edit is not None:
            req.edit.keep = edit[0]
            req.edit.append.extend(edit[1])
        if expect is not None:
            req.expect.CopyFrom(wire.expect_to_proto(expect))
        return wire.expect_from_proto(self._call("Commit", self.stub.Commit, req).context)

    def end(self, sid) -> bool:
        """Drop session `sid` on the drafter; whether it existed."""
        return self._call("EndDrafterSession", self.stub.EndDrafterSession,
                          drafter_pb2.EndDrafterSessionRequest(session_id=sid), 10).existed
