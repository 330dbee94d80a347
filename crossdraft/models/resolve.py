"""What a model spec names, and making sure it is available on this machine.

A spec is a catalog name (pulled on first use), a local Hugging Face model directory, a local
``.gguf`` file, or a Hugging Face Hub id ``org/name`` with an optional ``@revision`` (resolved,
downloaded and cached by huggingface_hub itself; see :mod:`crossdraft.models.hub`). A Hub repo that
holds GGUFs (``org/name:QUANT``, or one GGUF named with ``model_file``) loads its one GGUF the way a
local ``.gguf`` does. :func:`resolve_model` reads the spec without network; :func:`ensure_available`
pulls or downloads what the spec needs. Both the model loader and the tokenizer loader (which the
gateway imports) start here, so this module imports neither torch nor transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from crossdraft.errors import InvalidArgument, ModelError, UnknownModel
from crossdraft.models import hub as _hub
from crossdraft.models.catalog import CATALOG, CatalogEntry, cache_dir, catalog_names, is_pulled, model_path
from crossdraft.models.gguf import inspect_gguf, starts_with_gguf_magic
from crossdraft.models.pulling import pull

__all__ = ["ModelRef", "ensure_available", "resolve_model"]

@dataclass(frozen=True)
class ModelRef:
    """What a model spec points at.

    ``kind`` is ``"catalog"`` (``path`` is the cache directory, which may not exist yet: see
    ``pulled``), ``"hf_dir"`` (a local Hugging Face directory), ``"gguf"`` (a local ``.gguf``
    file; ``path`` is the file) or ``"hub"`` (a Hugging Face Hub id: ``name`` is the repo id,
    ``path`` the cached snapshot and ``revision`` its commit hash once resolved, else the repo's
    cache folder and ``""``; ``gguf_file`` the GGUF it loads, a path inside the snapshot, when the
    repo is served from a GGUF).
    """

    spec: str
    kind: Literal["catalog", "hf_dir", "gguf", "hub"]
    name: str
    path: Path
    entry: CatalogEntry | None = None
    revision: str = ""  # hub: the commit hash of the snapshot ("" until resolved); others: ""
    hub: _hub.HubSpec | None = None
    gguf_file: str = ""  # hub: the GGUF in the snapshot this loads ("" = safetensors/.bin, or not resolved yet)

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file this loads (a local one, or one in a Hub snapshot), or None."""
        if self.kind == "gguf":
            return self.path
        if self.kind == "hub" and self.gguf_file:
            return self.path / self.gguf_file
        return None

    @property
    def pulled(self) -> bool:
        if self.kind == "hub":
            return bool(self.revision)
        return self.kind != "catalog" or is_pulled(self.name)


def resolve_model(spec: str | os.PathLike[str], *, revision: str | None = None,
                  model_file: str | None = None) -> ModelRef:
    """Resolve a catalog name, a local Hugging Face model directory, a local ``.gguf`` file, or a
    Hugging Face Hub id ``org/name[:QUANT][@revision]``.

    Precedence: catalog name, then an existing local path, then a Hub id. A bare catalog name wins
    over a same-named directory in the working directory; write ``./name`` to mean the directory.
    An existing local path wins over a Hub id of the same spelling. ``revision`` (a branch, tag or
    commit; the same as ``@revision``) applies to Hub ids only, and so does ``model_file`` (the path
    of a GGUF in the repo, for a repo holding several; see :func:`crossdraft.models.hub.choose_gguf`).

    No network here: a Hub id that is in the cache resolves to its snapshot and commit hash; one
    that is not resolves unresolved (``revision == ""``; :func:`load_model` downloads it), unless
    HF_HUB_OFFLINE is set, which fails at once. Raises :class:`UnknownModel` if ``spec`` is none of
    these, and :class:`ModelError` for a directory without ``config.json``, a corrupt or truncated
    GGUF, or some other kind of file.
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise InvalidArgument("model", f"expected a catalog name or a path, got {type(spec).__name__}")
    text = os.fspath(spec)
    if not text.strip():
        raise InvalidArgument("model", "empty model name")
    revision = (str(revision).strip() or None) if revision is not None else None
    model_file = (str(model_file).strip() or None) if model_file is not None else None
    if isinstance(spec, str) and text in CATALOG:
        if revision:
            raise InvalidArgument("revision", f"{text!r} is a catalog model (pinned by sha256); a revision applies "
                                              "to Hugging Face Hub ids only")
        if model_file:
            raise InvalidArgument("model_file", f"{text!r} is a catalog model; a model file names a GGUF in a "
                                                "Hugging Face Hub repo")
        return ModelRef(text, "catalog", text, cache_dir(text), CATALOG[text])
    path = Path(text).expanduser()
    if not path.exists() and isinstance(spec, str) and _hub.is_hub_id(text):
        return _resolve_hub(text, revision, model_file)
    if revision:
        raise InvalidArgument("revision", f"{text!r} is a local path; a revision applies to Hugging Face Hub ids only")
    if model_file:
        raise InvalidArgument("model_file", f"{text!r} is a local path; a model file names a GGUF in a Hugging Face "
                                            "Hub repo (give a local GGUF's own path as the model)")
    if not path.exists():
        raise UnknownModel(
            f"unknown model {text!r}: not a catalog name ({catalog_names()}), no such local path, and not a "
            "Hugging Face Hub id (org/name, org/name@revision or org/name:QUANT)"
        )
    path = path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f"; to load a GGUF give the file path, e.g. {path / ggufs[0]}" if ggufs else ""
            raise ModelError(
                f"{path} is a directory but not a Hugging Face model directory (it has no config.json){hint}"
            )
        return ModelRef(text, "hf_dir", path.name, path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or starts_with_gguf_magic(path):
            inspect_gguf(path)
            return ModelRef(text, "gguf", path.stem, path)
        raise ModelError(
            f"{path} is neither a Hugging Face model directory nor a .gguf file "
            "(give the directory that holds config.json, or a .gguf file)"
        )
    raise ModelError(f"{path} is not a regular file or directory")


def _resolve_hub(text: str, revision: str | None, model_file: str | None) -> ModelRef:
    spec = _hub.parse_hub_spec(text, revision, file=model_file)
    hit = _hub.cached_snapshot(spec)
    if hit is None and _hub.is_offline():
        _hub.fetch(spec, weights=False)  # raises the "not in the cache" error naming what is cached
    if hit is None:
        return ModelRef(text, "hub", spec.repo_id, _hub.hub_cache_dir(), hub=spec)
    commit, snap = hit
    try:  # the GGUF the cached snapshot serves; offline a missing or ambiguous one fails here, at once
        gguf = _hub.choose_gguf(spec, _hub.snapshot_files(snap), cached=True)
    except InvalidArgument:
        if _hub.is_offline():
            raise
        gguf = None  # online: the repo's own listing decides when it is fetched
    return ModelRef(text, "hub", spec.repo_id, snap, revision=commit, hub=spec, gguf_file=gguf or "")


def _fetch_hub(ref: ModelRef, *, weights: bool, pull_missing: bool, progress: bool,
               trust_remote_code: bool) -> ModelRef:
    """``ref`` with its snapshot in the cache (downloaded if missing and allowed): path and commit set."""
    assert ref.hub is not None
    if not pull_missing:  # the cache only, as it is
        if ref.revision and (ref.gguf_file or (not ref.hub.names_gguf
                                               and (not weights or _hub.has_weights(ref.path)))):
            return ref
        raise ModelError(f"Hugging Face model {ref.spec!r} is not (completely) in the cache {_hub.hub_cache_dir()}; "
                         f"run `crossdraft models download {ref.hub.cli_args()}`")
    commit, snap, gguf = _hub.fetch_files(ref.hub, weights=weights, trust_remote_code=trust_remote_code,
                                          progress=progress)
    if gguf is not None:
        inspect_gguf(snap / gguf)  # a truncated or corrupt download fails here, naming the file
    return ModelRef(ref.spec, "hub", ref.name, snap, revision=commit, hub=ref.hub, gguf_file=gguf or "")


def ensure_available(ref: ModelRef, *, pull_missing: bool, progress: bool, weights: bool = True,
                     trust_remote_code: bool = False) -> ModelRef:
    """``ref`` ready to load: a catalog model pulled, a Hub model's snapshot in the cache (``weights=False``:
    its tokenizer and config only). Without ``pull_missing`` a missing model is an error saying what to run."""
    if ref.kind == "hub":
        return _fetch_hub(ref, weights=weights, pull_missing=pull_missing, progress=progress,
                          trust_remote_code=trust_remote_code)
    if ref.kind == "catalog" and not is_pulled(ref.name):
        if not pull_missing:
            model_path(ref.name)  # raises the "run `crossdraft models pull NAME`" error
        pull(ref.name, progress=progress)
    return ref
