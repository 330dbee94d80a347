"""Vocabularies: what each token id stands for in bytes, and how two tokenizers' ids map.

`tokenbytes` builds each tokenizer's byte table (the bytes every id stands for mid-text);
`codec` turns bytes into ids and back exactly; `mapping` holds the drafter <-> target
`VocabMapping` and `build_mapping`, with its disk cache in `cache`; `report` compares the mapping
with HF-style string matching; `frequency` orders a tokenizer's ids by frequency; `pair` holds
`TokenPair` (both tokenizers and the mapping as the round loop uses them) and the chat-template
helpers; `healing` indexes a vocabulary's bytes for token healing. It may import
`crossdraft.errors` and `crossdraft.home`; nothing of decoding, models, runtime, serving or the
services.
"""
