"""crossdraft: lossless speculative decoding across different vocabularies (UAG-TLI).

The core package holds transport-free pieces shared by the CLI, the in-process engine and the
services: sampling + acceptance math (:mod:`crossdraft.decoding.sampling`), vocabulary mapping
(:mod:`crossdraft.vocab.mapping`), model loading and the catalog (:mod:`crossdraft.models`) and the
reference engine (:mod:`crossdraft.engine`).
"""

__version__ = "0.1.0"
