"""VerifierService servicer: translates messages to :class:`crossdraft.runtime.workers.VerifierWorker` calls."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from crossdraft.serving import wire
from crossdraft.serving.modelserver import Loading
from crossdraft.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc

VERIFY_CALLS = Counter("crossdraft_verifier_verify_calls_total", "Verify RPCs")
DRAFTS = Counter("crossdraft_verifier_drafts_total", "Draft tokens verified")
ACCEPTED = Counter("crossdraft_verifier_accepted_total", "Draft tokens accepted")
FORWARD_SECONDS = Histogram("crossdraft_verifier_forward_seconds", "Verification forward time",
                            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0))
SYNCS = Counter("crossdraft_verifier_syncs_total", "Session syncs (full histories received)")


class VerifierServicer(verifier_pb2_grpc.VerifierServiceServicer):
    def __init__(self, state: Loading | None = None):
        self.state = state or Loading()

    def GetVerifierTokenizer(self, request, context):
        w = self.state.get()
        files = [common_pb2.TokenizerFile(name=n, content=c) for n, c in w.tokenizer_files().items()]
        return verifier_pb2.GetVerifierTokenizerResponse(files=files, tokenizer_digest=w.info()["tokenizer_digest"])

    def GetVerifierInfo(self, request, context):
        return verifier_pb2.GetVerifierInfoResponse(info=wire.model_info_to_proto(self.state.get().info()))

    def SyncVerifierSession(self, request, context):
        SYNCS.inc()
        reused, exp = self.state.get().sync(request.session_id, request.token_ids, prefill=request.prefill)
        return verifier_pb2.SyncVerifierSessionResponse(reused_tokens=reused, context=wire.expect_to_proto(exp))

    def ForkVerifierSession(self, request, context):
        shared, exp = self.state.get().fork(request.source_session_id, request.session_id)
        return verifier_pb2.ForkVerifierSessionResponse(shared_tokens=shared, context=wire.expect_to_proto(exp))

    def Verify(self, request, context):
        w = self.state.get()
        params = wire.params_from_proto(request.params)
        expect = wire.expect_from_proto(request.expect) if request.HasField("expect") else None
        q_rows = [wire.sparse_from_proto(m, f"q[{i}]") for i, m in enumerate(request.q)] or None
        top = int(request.top_logprobs) if request.HasField("top_logprobs") else -1
        r = w.verify(request.session_id, expect, list(request.draft_token_ids), q_rows, int(request.round_index),
                     params, int(request.seed), top, drop_last=bool(request.drop_last_token), gang=int(request.gang))
        VERIFY_CALLS.inc()
        DRAFTS.inc(len(request.draft_token_ids))
        ACCEPTED.inc(r.num_accepted)
        FORWARD_SECONDS.observe(r.forward_s)
        return verifier_pb2.VerifyResponse(num_accepted=r.num_accepted, next_token_id=r.next_token,
                                           accepted=r.accepted, forward_ms=r.forward_s * 1e3,
                                           context=wire.expect_to_proto(r.context), batch_size=r.batch_size,
                                           queue_wait_ms=r.queue_wait_s * 1e3,
                                           active_sessions=r.active_sessions, price=wire.price_to_proto(r.price),
                                           logprobs=[common_pb2.TokenLogprob(logprob=lp, top_ids=ids,
                                                                             top_logprobs=vals)
                                                     for lp, ids, vals in (r.logprobs or [])])

    def EndVerifierSession(self, request, context):
        return verifier_pb2.EndVerifierSessionResponse(existed=self.state.get().end(request.session_id))
