"""Vocabularies: what each token id stands for in bytes, and how two tokenizers' ids map.

`mapping` holds the byte tables, the drafter <-> target `VocabMapping` with its disk cache and
report, and `TokenPair` (both tokenizers and the mapping as the round loop uses them); `healing`
indexes a vocabulary's bytes for token healing. It may import `crossdraft.errors` and
`crossdraft.home`; nothing of decoding, models, runtime, serving or the services.
"""
