"""Decoding: the speculative round loop and its math, free of any model runtime or transport.

The round loop (`decode`) drives a verifier and a drafter through the ports of `ports` and the
messages of `messages`, keeps its view of the drafter's session and crosses the two vocabularies in
`drafter_view`, emits a request's tokens and text (stop strings, logprobs) through `output`, reports
in `stats` and logs rounds with `roundlog`; `sampling` and `coupled` hold the acceptance rule and the
seeded draws that keep the output exactly the target's distribution; `policy` chooses each round's
draft length from its acceptance model (`acceptance`) and cost model (`costmodel`).
It may import `crossdraft.errors`, `crossdraft.vocab` and torch/numpy; never transformers, gRPC,
Redis, `crossdraft.models`, `crossdraft.runtime`, `crossdraft.serving` or a service.
"""
