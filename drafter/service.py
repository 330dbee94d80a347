"""DrafterService servicer: translates messages to :class:`crossdraft.runtime.workers.DrafterWorker` calls."""

from __future__ import annotations

import os
import time

from prometheus_client import Counter, Histogram

from crossdraft.errors import InvalidArgument
from crossdraft.serving import wire
from crossdraft.serving.modelserver import Loading
from crossdraft.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc

DRAFT_TOKENS = Counter("crossdraft_drafter_tokens_total", "Draft tokens proposed")
DRAFT_CALLS = Counter("crossdraft_drafter_draft_calls_total", "Draft and DraftBlock calls")
TOKEN_SECONDS = Histogram("crossdraft_drafter_token_seconds", "Drafter forward time per proposed token",
                          buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
SYNCS = Counter("crossdraft_drafter_syncs_total", "Session syncs (full histories received)")
# what syncs cost: a session new to this drafter (or moved to it from another, or evicted here)
# counts its whole history; one whose cache holds the history counts what it does not hold
SYNCED_TOKENS = Counter("crossdraft_drafter_synced_tokens_total",
                        "History tokens received by session syncs beyond the cache entries reused "
                        "(reused_tokens): the drafter computes their keys and values anew")


def _edit(req):
    if not req.HasField("edit"):
        return None
    return int(req.edit.keep), list(req.edit.append)


def _expect(req):
    return wire.expect_from_proto(req.expect) if req.HasField("expect") else None


class DrafterServicer(drafter_pb2_grpc.DrafterServiceServicer):
    def __init__(self, state: Loading | None = None):
        self.state = state or Loading()
        # fault injection for tests and drills: a slow drafter (seconds added per proposed token)
        self.delay_s = float(os.environ.get("CROSSDRAFT_FAULT_DRAFT_DELAY_S", "0") or 0)

    def GetDrafterTokenizer(self, request, context):
        w = self.state.get()
        files = [common_pb2.TokenizerFile(name=n, content=c) for n, c in w.tokenizer_files().items()]
        return drafter_pb2.GetDrafterTokenizerResponse(files=files, tokenizer_digest=w.info()["tokenizer_digest"])

    def GetDrafterInfo(self, request, context):
        return drafter_pb2.GetDrafterInfoResponse(info=wire.model_info_to_proto(self.state.get().info()))

    def SetAllowedTokens(self, request, context):
        w = self.state.get()
        if request.vocab_size == 0:
            raise InvalidArgument("vocab_size", "must be > 0")
        mask = wire.unpack_mask(request.mask, request.vocab_size)
        tids = list(request.target_ids) or None
        return drafter_pb2.SetAllowedTokensResponse(allowed_count=w.set_allowed(request.allowed_key, mask, tids))

    def SyncDrafterSession(self, request, context):
        SYNCS.inc()
        reused, exp = self.state.get().sync(request.session_id, request.token_ids, prefill=request.prefill)
        SYNCED_TOKENS.inc(len(request.token_ids) - reused)
        return drafter_pb2.SyncDrafterSessionResponse(reused_tokens=reused, context=wire.expect_to_proto(exp))

    def ForkDrafterSession(self, request, context):
        shared, exp = self.state.get().fork(request.source_session_id, request.session_id)
        return drafter_pb2.ForkDrafterSessionResponse(shared_tokens=shared, context=wire.expect_to_proto(exp))

    def _draft_iter(self, request, w):
        DRAFT_CALLS.inc()
        params = wire.params_from_proto(request.params)
        return w.draft_iter(request.session_id, _edit(request), _expect(request), int(request.num_draft_tokens),
                            int(request.round_index), params, int(request.seed), float(request.stop_below),
                            request.allowed_key, float(request.stop_cumulative_below), bool(request.heal),
                            position=int(request.position) or -1, runner_up=bool(request.runner_up),
                            gang=int(request.gang))

    def Draft(self, request, context):
        w = self.state.get()
        return self._stream(self._draft_iter(request, w), context, int(request.num_draft_tokens), w)

    def DraftBlock(self, request, context):
        """The whole block in one reply (Draft's messages, gathered)."""
        w = self.state.get()
        it = self._draft_iter(request, w)
        tokens = []
        try:
            for tok in it:
                if self.delay_s:
                    time.sleep(self.delay_s)
                tokens.append(self._message(tok, w))
                if tok.last:
                    break
        finally:
            it.close()
        reply = drafter_pb2.DraftBlockResponse(tokens=tokens)
        if not (tokens and tokens[-1].last):  # no proposal ended the block
            reply.done.CopyFrom(drafter_pb2.DraftDone(num_tokens=len(tokens), stop_reason="length",
                                                      price=wire.price_to_proto(w.price())))
        return reply

    @staticmethod
    def _message(tok, w):
        DRAFT_TOKENS.inc()
        TOKEN_SECONDS.observe(tok.forward_s)
        msg = drafter_pb2.DraftToken(token_id=tok.id, forward_ms=tok.forward_s * 1e3, last=tok.last,
                                     heals=tok.heals, queue_wait_ms=tok.queue_s * 1e3,
                                     batch_rows=tok.batch_rows)
        if tok.last:  # the block's last proposal carries the drafter's price of a step
            price = wire.price_to_proto(w.price())
            if price is not None:
                msg.price.CopyFrom(price)
        if tok.alt >= 0:
            msg.prob, msg.runner_up_id, msg.runner_up_prob = tok.prob, tok.alt, tok.alt_prob
        if tok.q_ids is not None:
            msg.q_token_ids.extend(tok.q_ids.tolist())
            msg.q_probs.extend(tok.q_probs.tolist())
        return msg

    def _stream(self, it, context, k: int, w):
        n = 0
        ended = False
        try:
            for tok in it:
                n += 1
                if self.delay_s:
                    time.sleep(self.delay_s)
                msg = self._message(tok, w)
                ended = tok.last
                yield drafter_pb2.DraftResponse(token=msg)
                if ended or not context.is_active():
                    return
        finally:
            it.close()
        if not ended:  # one message per proposal on the hot path; the summary only when no proposal ended it
            yield drafter_pb2.DraftResponse(done=drafter_pb2.DraftDone(num_tokens=n, stop_reason="length",
                                                                       price=wire.price_to_proto(w.price())))

    def Commit(self, request, context):
        exp = self.state.get().commit(request.session_id, _edit(request), _expect(request))
        return drafter_pb2.CommitResponse(context=wire.expect_to_proto(exp))

    def EndDrafterSession(self, request, context):
        return drafter_pb2.EndDrafterSessionResponse(existed=self.state.get().end(request.session_id))

