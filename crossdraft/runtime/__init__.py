"""Runtime: one loaded model serving many sessions, as a drafter or verifier pod runs it.

`sessions` (one session's ids and KV cache; drafting and lossless verification), `workers` (many
sessions on one model, the ports' in-process adapters), `kvpool` (the paged KV pool and the ragged
batched forward), `batching` (the scheduler that gathers rows of many sessions into one forward),
`graphs` (CUDA graphs of that forward), `costs` (forward costs timed at load) and `memory`.
It may import decoding, vocab, models and `crossdraft.errors`; nothing of serving or the services.
"""
