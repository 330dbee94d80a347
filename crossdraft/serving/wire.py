"""Conversions between the wire messages (crossdraft.v1) and the core's types."""

from __future__ import annotations

import numpy as np

from crossdraft.argtypes import available_cpus
from crossdraft.decoding.messages import Expect
from crossdraft.decoding.sampling import SamplingParams
from crossdraft.errors import InvalidArgument
from crossdraft.v1 import common_pb2


def params_from_proto(m: common_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=m.temperature, top_k=m.top_k, top_p=m.top_p,
                          repetition_penalty=m.repetition_penalty, coupled=bool(m.coupled))


def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                     repetition_penalty=p.repetition_penalty, coupled=p.coupled)


def expect_from_proto(m: common_pb2.ContextCheck) -> Expect:
    return Expect(int(m.length), int(m.crc32))


def expect_to_proto(e: Expect | None) -> common_pb2.ContextCheck | None:
    return None if e is None else common_pb2.ContextCheck(length=e.length, crc32=e.crc32)


def model_info_to_proto(d: dict) -> common_pb2.ModelInfo:
    """A model server's ModelInfo about itself; `cpus` defaults to this process's CPU affinity set
    (what it computes on, so a gateway can tell two servers on one host apart, gateway.discovery)."""
    if "cpus" not in d:
        d = dict(d, cpus=sorted(available_cpus()))
    return common_pb2.ModelInfo(**d)


def model_info_from_proto(m: common_pb2.ModelInfo) -> dict:
    return dict(model_name=m.model_name, vocab_size=m.vocab_size, tokenizer_digest=m.tokenizer_digest, dtype=m.dtype,
                device=m.device, body_bytes=m.body_bytes, head_row_bytes=m.head_row_bytes,
                max_context_tokens=m.max_context_tokens, eos_token_ids=list(m.eos_token_ids),
                max_sessions=m.max_sessions, active_sessions=m.active_sessions, instance_id=m.instance_id,
                forward_ms=[float(x) for x in m.forward_ms], kv_blocks_total=m.kv_blocks_total,
                kv_blocks_used=m.kv_blocks_used, kv_block_size=m.kv_block_size, max_batch_rows=m.max_batch_rows,
                tokenizer_files_digest=m.tokenizer_files_digest, revision=m.revision, features=list(m.features),
                cpus=[int(c) for c in m.cpus])


def pack_mask(mask: np.ndarray) -> bytes:
    return np.packbits(np.asarray(mask, dtype=bool), bitorder="little").tobytes()


def unpack_mask(data: bytes, size: int) -> np.ndarray:
    if len(data) * 8 < size or len(data) > (size + 7) // 8:
        raise InvalidArgument("mask",
                              f"must hold exactly ceil(vocab_size / 8) = {(size + 7) // 8} bytes, got {len(data)}")
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[:size].astype(bool)


def sparse_to_proto(ids, probs) -> common_pb2.SparseDistribution:
    return common_pb2.SparseDistribution(token_ids=np.asarray(ids).tolist(), probs=np.asarray(probs).tolist())


def sparse_from_proto(m: common_pb2.SparseDistribution, field: str) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray(m.token_ids, dtype=np.int64)
    probs = np.asarray(m.probs, dtype=np.float64)
    if ids.shape != probs.shape:
        raise InvalidArgument(field, f"{len(ids)} token_ids but {len(probs)} probs")
    return ids, probs


def price_to_proto(p) -> common_pb2.Price | None:
    """A server's price of a forward (crossdraft.runtime.price.Price) on the wire; None stays unset."""
    if p is None:
        return None
    return common_pb2.Price(base_ms=p.base_ms, row_ms=p.row_ms, token_ms=p.token_ms, forwards=p.forwards)


def price_from_proto(owner, field: str = "price"):
    """The Price in ``owner``'s ``field``, or None where it is unset (an older or unbatched server) or
    not a usable price (a peer's numbers are not trusted to be finite and positive)."""
    from crossdraft.runtime.price import Price

    if not owner.HasField(field):
        return None
    m = getattr(owner, field)
    vals = (m.base_ms, m.row_ms, m.token_ms)
    if not all(np.isfinite(v) and v >= 0 for v in vals) or m.base_ms + m.row_ms + m.token_ms <= 0:
        return None
    return Price(float(m.base_ms), float(m.row_ms), float(m.token_ms), int(m.forwards))
