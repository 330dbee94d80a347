"""Decoding: the speculative round loop and its math, free of any model runtime or transport.

The round loop (`decode`) drives a verifier and a drafter through the ports of `ports` and the
messages of `messages`; `sampling` and `coupled` hold the acceptance rule and the seeded draws that
keep the output exactly the target's distribution; `policy` chooses each round's draft length from
its acceptance model (`acceptance`) and cost model (`costmodel`).
It may import `crossdraft.errors`, `crossdraft.vocab` and torch/numpy; never transformers, gRPC,
Redis, `crossdraft.models`, `crossdraft.runtime`, `crossdraft.serving` or a service.
"""
