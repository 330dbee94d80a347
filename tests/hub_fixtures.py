"""A Hugging Face Hub cache on disk, laid out the way huggingface_hub writes it, for offline tests.

    <cache>/models--<org>--<name>/
        blobs/<sha256>                      file contents
        refs/main                           the commit hash main points at
        snapshots/<commit>/<file> -> ../../blobs/<sha256>

The Hub itself is never reachable from the test machines; this is what a download leaves behind,
and what HF_HUB_OFFLINE=1 resolves from.
"""

from __future__ import annotations

import hashlib
import os
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
