"""Regressions found by the gRPC fuzzer (tests/e2e/test_grpc_fuzz.py), one focused test each: every
one was an INTERNAL / UNKNOWN answer, or an INVALID_ARGUMENT naming no field of the request."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from crossdraft.decoding.messages import Expect
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument
from crossdraft.runtime.workers import DrafterWorker, VerifierWorker
from crossdraft.serving import rpc
from crossdraft.v1 import drafter_pb2, drafter_pb2_grpc
from tests.tiny_models import tiny_lm
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer

GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def lm():
    lm = tiny_lm(bytelevel_bpe_tokenizer(), seed=1, arch="qwen2")
    lm.path = "tiny"
    lm.kind = "hf_dir"
    return lm


class _Echo(drafter_pb2_grpc.DrafterServiceServicer):
    def SetAllowedTokens(self, request, context):
        return drafter_pb2.SetAllowedTokensResponse(allowed_count=len(request.allowed_key))

    def Draft(self, request, context):
        yield drafter_pb2.DraftResponse(done=drafter_pb2.DraftDone(num_tokens=0))


@pytest.mark.parametrize("path, streaming", [("SetAllowedTokens", False), ("Draft", True)])
@pytest.mark.parametrize("data", [b"\x00", b"\x0a\x04\xff\xfe\xc3\x28", b"\x0a\x05ab"])
def test_undecodable_request_bytes_are_invalid_argument_not_internal(path, streaming, data):
    """Bytes that do not parse as the request message (a truncated field, invalid UTF-8 in a string):
    grpc answered INTERNAL "Exception deserializing request!"; now INVALID_ARGUMENT naming `request`."""
    svc = _Echo()
    server, port, _ = rpc.build_server([lambda s: drafter_pb2_grpc.add_DrafterServiceServicer_to_server(svc, s)],
                                       ["crossdraft.v1.DrafterService"], "127.0.0.1", 0, max_workers=2)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            method = f"/crossdraft.v1.DrafterService/{path}"
            call = ch.unary_stream(method) if streaming else ch.unary_unary(method)
            with pytest.raises(grpc.RpcError) as e:
                r = call(data, timeout=10)
                list(r) if streaming else r
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert e.value.details().startswith("request: cannot be decoded"), e.value.details()
            # a valid request on the same server still works
            ok = ch.unary_unary(method)(b"", timeout=10) if not streaming else list(ch.unary_stream(method)(b""))
            assert ok is not None
    finally:
        server.stop(None).wait(5)


@pytest.mark.parametrize("seed, round_index, field", [(2**64 - 1, 0, "seed"), (2**63, 0, "seed"),
                                                      (0, 2**64 - 1, "round_index"), (0, 2**63, "round_index")])
def test_uint64_seeds_and_rounds_beyond_int63_are_invalid_argument(lm, seed, round_index, field):
    """The draws hash seeds and rounds as signed 64-bit integers: a sampling Verify or Draft with a
    seed or round_index >= 2^63 (legal uint64s on the wire) raised struct.error (INTERNAL)."""
    v = VerifierWorker(lm)
    v.sync("s", [1, 2, 3])
    with pytest.raises(InvalidArgument, match=f"^{field}: must be <="):
        v.verify("s", None, [], None, round_index, SAMPLE, seed)
    assert v.verify("s", Expect.of([1, 2, 3]), [], None, 2**63 - 1, SAMPLE, 2**63 - 1).context.length == 4
    d = DrafterWorker(lm)
    d.sync("s", [1, 2, 3])
    with pytest.raises(InvalidArgument, match=f"^{field}: must be <="):
        list(d.draft_iter("s", None, None, 2, round_index, SAMPLE, seed, 0.0, ""))
    assert len(list(d.draft_iter("s", None, None, 2, 2**63 - 1, SAMPLE, 2**63 - 1, 0.0, ""))) == 2


@pytest.mark.parametrize("position", [2**62 + 1, 2**63, 2**64 - 1])
def test_coupled_positions_beyond_the_hash_range_are_invalid_argument(lm, position):
    """A coupled Draft's position (uint64 on the wire) plus the block's offsets is hashed as a signed
    64-bit integer: a position past 2^62 is refused naming the field, one at the bound drafts."""
    coupled = SamplingParams(temperature=1.0, coupled=True)
    d = DrafterWorker(lm)
    d.sync("s", [1, 2, 3])
    with pytest.raises(InvalidArgument, match="^position: must be <="):
        list(d.draft_iter("s", None, None, 2, 0, coupled, 1, 0.0, "", position=position))
    assert len(list(d.draft_iter("s", None, None, 2, 0, coupled, 1, 0.0, "", position=2**62))) == 2


def test_context_overflow_names_the_field_that_overflowed(lm):
    """A history pushed past the context by a Draft's num_draft_tokens, an edit's append or a Verify's
    drafts was reported as "token_ids", a field those requests do not have."""
    ctx = lm.model.config.max_position_embeddings
    ids = [5] * (ctx - 1)
    d = DrafterWorker(lm)
    d.sync("s", ids)
    with pytest.raises(InvalidArgument, match="^num_draft_tokens: .*exceed the model's context"):
        list(d.draft_iter("s", None, None, 4, 0, GREEDY, 0, 0.0, ""))
    with pytest.raises(InvalidArgument, match="^edit.append: .*exceed the model's context"):
        d.commit("s", (len(ids), [1, 2, 3]), None)
    v = VerifierWorker(lm)
    v.sync("s", ids)
    with pytest.raises(InvalidArgument, match="^draft_token_ids: .*exceed the model's context"):
        v.verify("s", None, [1, 2], None, 0, GREEDY, 0)
    with pytest.raises(InvalidArgument, match="^token_ids: .*exceed the model's context"):
        v.sync("s", ids + [1, 2])


@pytest.mark.parametrize("rp", [5e-324, 1e-40, 1e308])
def test_extreme_repetition_penalty_samples_instead_of_nan(lm, rp):
    """A repetition_penalty of 5e-324 or 1e-40 (legal: > 0) sent penalised logits to +inf, and 1e308
    with every token seen to -inf: inf - inf = NaN, and sampling raised ValueError (INTERNAL)."""
    import torch

    from crossdraft.decoding import sampling as S

    logits = torch.tensor([[1.0, -2.0, 0.5, 3.0], [-1.0, -2.0, -0.5, -3.0]])
    for seen in (torch.tensor([True, True, False, False]), torch.ones(4, dtype=torch.bool)):
        for t in (0.0, 0.7):
            out = S.process_logits(logits, SamplingParams(temperature=t, repetition_penalty=rp), seen.expand(2, 4))
            assert not torch.isnan(out).any() and torch.isfinite(S.probabilities(out)).all(), (seen, t, out)
    ids = [1, 2, 3, 4] * 8
    v = VerifierWorker(lm)
    v.sync("s", ids)
    params = SamplingParams(temperature=0.7, repetition_penalty=rp)
    r = v.verify("s", Expect.of(ids), [7], [(np.array([7]), np.array([1.0]))], 0, params, 5)
    assert 0 <= r.next_token < v.vocab
    d = DrafterWorker(lm)
    d.sync("s", ids)
    assert len(list(d.draft_iter("s", None, None, 3, 0, params, 5, 0.0, ""))) == 3
