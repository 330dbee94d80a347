"""A Hugging Face Hub cache on disk, laid out the way huggingface_hub writes it, for offline tests.

    <cache>/models--<org>--<name>/
        blobs/<sha256>                      file contents
        refs/main                           the commit hash main points at
        snapshots/<commit>/<file> -> ../../blobs/<sha256>

The Hub itself is never reachable from the test machines; this is what a download leaves behind,
and what HF_HUB_OFFLINE=1 resolves from.

GGUF repos: :func:`gguf_sources` writes tiny Llama GGUFs (random weights, the suite's trained
byte-level BPE tokenizer) once per test process, for snapshots of repos that hold only GGUFs.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def fake_commit(seed: str) -> str:
    """A 40-hex commit hash (deterministic per seed)."""
    return hashlib.sha1(seed.encode()).hexdigest()


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...] = ("main",),
                 only: tuple[str, ...] | None = None) -> Path:
    """Put the files of model directory ``src`` into ``cache`` as snapshot ``commit`` of ``repo_id``;
    each name in ``refs`` (a branch or tag) points at it. ``only``: copy just these file names.
    Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    blobs, snap = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if not f.is_file() or (only is not None and f.name not in only):
            continue
        data = f.read_bytes()
        blob = blobs / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snap / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, snap), link)
    for ref in refs:
        p = repo / "refs" / ref
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(commit)  # huggingface_hub writes the hash without a newline
    return snap


def hub_env(hf_home: Path) -> dict[str, str]:
    """Environment of an offline process that resolves Hub ids from ``hf_home``'s cache. Its own
    $CROSSDRAFT_HOME too: cost tables timed for the tiny test models stay out of the user's cache."""
    return {"HF_HOME": str(hf_home), "HF_HUB_CACHE": str(hf_home / "hub"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
            "CROSSDRAFT_HOME": str(hf_home / "crossdraft-home")}


GGUF_QUANTS = ("Q8_0", "Q4_0")  # the quantisations gguf_sources() writes, one file each


def write_gguf(path: Path, quant: str = "Q8_0", seed: int = 0) -> Path:
    """A 2-layer Llama GGUF (hidden 32, GQA 4/2 heads) at ``path`` with the test suite's trained
    byte-level BPE tokenizer (tests/tokenizers_fixtures, 400 tokens) and random weights; the
    matrices stored as ``quant`` (a gguf quantisation type: Q8_0, Q4_0, F16, F32, ...), the norms as
    F32. The same ``seed`` gives the same weights before quantisation."""
    import gguf
    import numpy as np

    from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer

    tok = bytelevel_bpe_tokenizer()
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    by_id = {i: t for t, i in tok.get_vocab().items()}
    tokens = [by_id[i] for i in range(len(by_id))]
    special = set(tok.all_special_tokens)
    types = [3 if t in special else 1 for t in tokens]  # 3 = CONTROL: special tokens
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    qtype = gguf.GGMLQuantizationType[quant]
    rng = np.random.default_rng(seed)
    V, H, F, L = len(tokens), 32, 64, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"tiny test llama {quant}")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(F)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(int(qtype) if quant not in ("F32", "F16") else (0 if quant == "F32" else 1))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)

    def matrix(name: str, rows: int, cols: int, scale: float = 0.5) -> None:
        a = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    matrix("token_embd.weight", V, H, 2.0)  # tied: also the LM head (peaked next-token distributions)
    for b in range(L):
        w.add_tensor(f"blk.{b}.attn_norm.weight", np.ones(H, np.float32))
        matrix(f"blk.{b}.attn_q.weight", H, H)
        matrix(f"blk.{b}.attn_k.weight", H // 2, H)
        matrix(f"blk.{b}.attn_v.weight", H // 2, H)
        matrix(f"blk.{b}.attn_output.weight", H, H)
        w.add_tensor(f"blk.{b}.ffn_norm.weight", np.ones(H, np.float32))
        matrix(f"blk.{b}.ffn_gate.weight", F, H)
        matrix(f"blk.{b}.ffn_up.weight", F, H)
        matrix(f"blk.{b}.ffn_down.weight", H, F)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@functools.lru_cache(maxsize=None)
def gguf_sources() -> Path:
    """A directory (written once per test process, removed at exit) holding ``tiny-<QUANT>.gguf``
    for each of :data:`GGUF_QUANTS` (the same weights, quantised two ways), the two parts of a GGUF
    split by llama.cpp's gguf-split (``tiny-F16-0000N-of-00002.gguf``; the names are what counts:
    split GGUFs are refused before they are read) and a README.md."""
    d = Path(tempfile.mkdtemp(prefix="crossdraft-gguf-"))
    atexit.register(shutil.rmtree, d, True)
    for q in GGUF_QUANTS:
        write_gguf(d / f"tiny-{q}.gguf", q)
    for i in (1, 2):
        (d / f"tiny-F16-0000{i}-of-00002.gguf").write_bytes(b"GGUF" + bytes([i]) * 60)
    (d / "README.md").write_text("tiny GGUFs for crossdraft's tests\n")
    return d
