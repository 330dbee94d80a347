"""Models named by Hugging Face Hub id: ``org/name``, ``org/name@revision``, ``org/name:QUANT``.

Resolution goes through ``huggingface_hub`` itself (``snapshot_download``), so everything it
honours applies: ``HF_HOME`` / ``HF_HUB_CACHE`` (the cache, shared with transformers and every
other tool), ``HF_TOKEN`` / ``HF_TOKEN_PATH`` (gated and private repos), ``HF_HUB_OFFLINE``
(never touch the network; resolve from the cache only), ``HF_ENDPOINT`` (a mirror). The cache
location and the offline switch are read from the environment on every call, not once at import.

What is downloaded: the config, generation config, tokenizer files and one weights format
(safetensors when the repo has them, else PyTorch ``.bin``), never ONNX/GGUF/Flax copies or
``original/`` checkpoints; ``*.py`` only with ``trust_remote_code``. A tokenizer-only download
(:func:`fetch`, ``weights=False``: ``crossdraft vocab``) skips the weights.

GGUF repos: a repo without safetensors/``.bin`` weights but with ``*.gguf`` files, or any repo
when the spec names a GGUF (``org/name:QUANT``, or a file name: ``HubSpec.file``), is served from
one GGUF file, and only that file is downloaded (it carries the config and the tokenizer). The
quantisation tag picks the GGUF whose path carries it as a separate word (``Q4_K_M`` matches
``model-q4_k_m.gguf``, not ``model-Q4_K_M_L.gguf``), case-insensitively; a repo with several GGUFs
and neither a tag nor a file named is refused with the list (:func:`choose_gguf`). GGUFs split by
llama.cpp's gguf-split (``-00001-of-0000N.gguf``) are refused: each part is a GGUF of its own
holding some of the tensors, which transformers' GGUF loader does not join.

The revision a model is served at is the snapshot's commit hash (``snapshots/<hash>``), also when
the spec named a branch or tag: that is what ModelInfo.revision reports.

Every failure is a crossdraft error that names the model and says what to do: an unknown repo or
revision (:class:`UnknownModel`), a gated or private repo without a usable token, or a model that is
not in the cache while offline (:class:`ModelError`).
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from pathlib import Path

from crossdraft.errors import InvalidArgument, ModelError, UnknownModel

__all__ = ["HubSpec", "cached_snapshot", "choose_gguf", "fetch", "fetch_files", "has_weights", "hub_cache_dir",
           "is_hub_id", "is_offline", "parse_hub_spec", "snapshot_files", "translate_error"]

# org/name, as the Hub spells repo ids (letters, digits, '-', '_', '.'; no '--' or '..'), with an
# optional @revision (a branch, a tag or a commit hash; branches may contain '/', never ':') and an
# optional :QUANT (a GGUF quantisation tag such as Q4_K_M), before or after the revision
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
_QUANT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
_HUB_ID = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<q1>{_QUANT}))?(?:@(?P<rev>[^\s@:]+))?"
                     rf"(?::(?P<q2>{_QUANT}))?$")
# llama.cpp's gguf-split names its parts <stem>-00001-of-00003.gguf
GGUF_SPLIT = re.compile(r"-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
COMMIT_HASH = re.compile(r"^[0-9a-f]{40}$")

CONFIG_PATTERNS = ["config.json", "generation_config.json", "*.jinja"]
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt",
                      "merges.txt", "*.model", "*.tiktoken", "chat_template.json", "preprocessor_config.json"]
SAFETENSORS_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]
BIN_PATTERNS = ["*.bin", "*.bin.index.json"]
# never fetched: other formats of the same weights
IGNORE_PATTERNS = ["original/*", "*.gguf", "*.onnx", "*.onnx_data", "onnx/*", "*.msgpack", "*.h5", "*.ot",
                   "*.tflite", "coreml/*", "openvino/*"]


@dataclass(frozen=True)
class HubSpec:
    repo_id: str
    revision: str | None  # None = the default branch ("main")
    quant: str | None = None  # a GGUF quantisation tag (org/name:QUANT): the GGUF whose path carries it
    file: str | None = None  # a GGUF's path in the repo (--model-file): that GGUF

    @property
    def ref(self) -> str:
        return self.revision or "main"

    @property
    def names_gguf(self) -> bool:
        """Whether the spec asks for a GGUF (a tag or a file), whatever else the repo holds."""
        return bool(self.quant or self.file)

    def __str__(self) -> str:
        return self.repo_id + (f":{self.quant}" if self.quant else "") + (f"@{self.revision}" if self.revision else "")

    def cli_args(self) -> str:
        """The spec as `crossdraft models download` arguments (the file as --file)."""
        return str(self) + (f" --file {self.file}" if self.file else "")


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is spelled like a Hub id (``org/name[:QUANT][@rev]``); says nothing of its existence."""
    m = _HUB_ID.match(text)
    return bool(m) and ".." not in m.group("repo") and "--" not in m.group("repo") \
        and not m.group("repo").endswith((".", "-")) and not (m.group("q1") and m.group("q2"))


def _check_file(file: str) -> str:
    """A GGUF path inside a repo, as --model-file names it: relative, no '..', ending in .gguf."""
    f = file.strip().replace("\\", "/")
    if not f or f.startswith("/") or ".." in f.split("/") or not f.lower().endswith(".gguf") \
            or any(c.isspace() for c in f):
        raise InvalidArgument("model_file", f"{file!r} is not the path of a .gguf file inside a Hub repo "
                                            "(e.g. model-Q4_K_M.gguf or Q4_K_M/model.gguf)")
    return f


def parse_hub_spec(text: str, revision: str | None = None, file: str | None = None) -> HubSpec:
    """``org/name``, ``org/name@rev``, ``org/name:QUANT`` or ``org/name:QUANT@rev`` (also
    ``org/name@rev:QUANT``), plus an optional separate ``revision`` (which must agree with ``@rev``)
    and ``file``, a GGUF's path in the repo (which must carry ``QUANT`` when both are given)."""
    if not is_hub_id(text):
        raise InvalidArgument("model", f"{text!r} is not a Hugging Face Hub id (org/name, org/name@revision or "
                                       "org/name:QUANT for a GGUF repo)")
    m = _HUB_ID.match(text)
    rev = m.group("rev")
    quant = m.group("q1") or m.group("q2")
    if revision is not None and str(revision).strip():
        revision = str(revision).strip()
        if rev and rev != revision:
            raise InvalidArgument("revision", f"{text!r} names revision {rev!r} but --revision says {revision!r}; "
                                              "give it once")
        rev = revision
    f = _check_file(str(file)) if file is not None and str(file).strip() else None
    if f and quant and not _carries_tag(f, quant):
        raise InvalidArgument("model_file", f"{f!r} does not carry the quantisation tag {quant!r} that {text!r} "
                                            "names; give one of them")
    return HubSpec(m.group("repo"), rev or None, quant, f)


def _carries_tag(path: str, tag: str) -> bool:
    """Whether ``tag`` is a word of ``path`` (case-insensitive): not preceded by a letter or digit,
    not followed by a letter, digit or '_' (so Q4_K does not match Q4_K_M)."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(tag)}(?![A-Za-z0-9_])", path, re.IGNORECASE) is not None


def _listing(names: list[str], limit: int = 24) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _split_refusal(spec: HubSpec, name: str) -> InvalidArgument:
    m = GGUF_SPLIT.search(name)
    return InvalidArgument(
        "model_file" if spec.file else "model",
        f"{name!r} of {spec.repo_id!r} is part {int(m.group('part'))} of a GGUF split into {int(m.group('count'))} "
        "files (llama.cpp's gguf-split), which crossdraft does not load: merge the parts (`llama-gguf-split "
        "--merge <first part> merged.gguf`) and load the merged file by its path, or pick a quantisation the repo "
        "holds in one file")


def choose_gguf(spec: HubSpec, names: list[str], *, cached: bool = False) -> str | None:
    """The GGUF (its path in the repo) that ``spec`` loads from a repo holding the files ``names``,
    or None when the spec loads the repo's safetensors/.bin weights (it names no GGUF and the repo
    has such weights, or no GGUF at all).

    Raises :class:`InvalidArgument` when the named file or tag is not there, when several GGUFs fit
    (listing them), and for a split GGUF. ``cached``: ``names`` is what the cache holds of the
    repo, not the repo's listing; the messages say so.
    """
    ggufs = sorted(n for n in names if n.lower().endswith(".gguf"))
    where = f"the cached snapshot of {str(spec)!r}" if cached else f"Hugging Face repo {spec.repo_id!r}"
    hint = f"; {_download_hint(spec)}" if cached else ""
    held = f"it holds {_listing(ggufs)}" if ggufs else "it holds no .gguf file"
    if spec.file:
        if spec.file not in ggufs:
            raise InvalidArgument("model_file", f"{where} has no file {spec.file!r} ({held}){hint}")
        chosen = spec.file
    elif spec.quant:
        fits = [g for g in ggufs if _carries_tag(g, spec.quant)]
        if not fits:
            raise InvalidArgument("model", f"no GGUF of {where} carries the quantisation tag {spec.quant!r} "
                                           f"({held}){hint}")
        whole = [g for g in fits if not GGUF_SPLIT.search(g)]
        if len(whole) > 1 or (not whole and len({GGUF_SPLIT.sub("", g) for g in fits}) > 1):
            raise InvalidArgument("model", f"{len(fits)} GGUFs of {where} carry the quantisation tag "
                                           f"{spec.quant!r}: {_listing(fits)}; name one with --model-file "
                                           "(--target-file / --drafter-file)")
        chosen = whole[0] if whole else fits[0]
    else:
        if not ggufs or any(n.endswith((".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json"))
                            for n in names):
            return None
        sets = sorted({GGUF_SPLIT.sub("", g) for g in ggufs})
        if len(sets) > 1:
            raise InvalidArgument("model_file", f"{where} holds {len(ggufs)} GGUF files: {_listing(ggufs)}; name "
                                                f"one: {spec.repo_id}:<QUANT> (a quantisation tag in its name), or "
                                                "its path with --model-file (--target-file / --drafter-file; the "
                                                f"chart's modelFile){hint}")
        chosen = ggufs[0]
    if GGUF_SPLIT.search(chosen):
        raise _split_refusal(spec, chosen)
    return chosen


def snapshot_files(snap: Path) -> list[str]:
    """Paths (relative, '/'-separated) of the files in a snapshot directory, links included."""
    out = []
    for dirpath, _dirs, files in os.walk(snap):
        for f in files:
            out.append(os.path.relpath(os.path.join(dirpath, f), snap).replace(os.sep, "/"))
    return sorted(out)


def _is_true(v: str | None) -> bool:
    return (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE), read now."""
    return _is_true(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def hub_cache_dir() -> Path:
    """The Hub cache, by huggingface_hub's rules, read now: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE,
    $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def _repo_dir(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def has_weights(d: Path) -> bool:
    """Whether a snapshot directory holds weights (safetensors or .bin, or their index)."""
    return any(d.glob("*.safetensors")) or any(d.glob("*.bin")) or any(d.glob("*.safetensors.index.json")) \
        or any(d.glob("*.bin.index.json"))


def cached_snapshot(spec: HubSpec) -> tuple[str, Path] | None:
    """(commit hash, snapshot dir) of ``spec`` in the cache, or None (no network)."""
    repo = _repo_dir(spec.repo_id)
    rev = spec.ref
    commit = rev if COMMIT_HASH.match(rev) else None
    if commit is None:
        try:
            commit = (repo / "refs" / rev).read_text().strip()
        except (OSError, ValueError):
            return None
    snap = repo / "snapshots" / commit
    return (commit, snap) if snap.is_dir() else None


def _cached_refs(repo_id: str) -> str:
    """What the cache holds of a repo, for error messages: "main -> abc1234, ..."."""
    repo = _repo_dir(repo_id)
    refs = []
    ref_dir = repo / "refs"
    if ref_dir.is_dir():
        for p in sorted(ref_dir.rglob("*")):
            if p.is_file():
                try:
                    refs.append(f"{p.relative_to(ref_dir)} -> {p.read_text().strip()}")
                except OSError:
                    pass
    snaps = sorted(p.name for p in (repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    named = {r.split(" -> ")[1] for r in refs}
    refs += [s for s in snaps if s not in named]
    return ", ".join(refs)


def _hub_errors():
    from huggingface_hub import errors as E

    return E


def _download_hint(spec: HubSpec) -> str:
    hint = (f"download it where the Hub is reachable (`crossdraft models download {spec.cli_args()}`, or the "
            f"chart's init container) into this cache ({hub_cache_dir()})")
    return hint + (", or unset HF_HUB_OFFLINE" if is_offline() else "")


def _offline_error(spec: HubSpec, why: str = "") -> ModelError:
    """The spec is not in the cache and we may not (or cannot) ask the Hub."""
    cached = _cached_refs(spec.repo_id) if _repo_dir(spec.repo_id).is_dir() else ""
    where = why or ("HF_HUB_OFFLINE is set" if is_offline() else "the Hub could not be reached")
    if cached:
        return UnknownModel(
            f"revision {spec.ref!r} of Hugging Face model {spec.repo_id!r} is not in the cache ({where}); the cache "
            f"holds {cached}: name one of those (e.g. {spec.repo_id}@<commit>) or {_download_hint(spec)}")
    return ModelError(f"Hugging Face model {str(spec)!r} is not in the cache {hub_cache_dir()} ({where}); "
                      f"{_download_hint(spec)}")


def translate_error(spec: HubSpec, e: BaseException) -> ModelError:
    """huggingface_hub's exception -> a crossdraft error naming the model and what to do."""
    E = _hub_errors()
    url = f"https://huggingface.co/{spec.repo_id}"
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    token_file = Path(os.environ.get("HF_TOKEN_PATH") or os.path.join(hf_home, "token")).expanduser()
    token_set = bool(os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or token_file.is_file())
    if isinstance(e, E.GatedRepoError):
        fix = ("the token given (HF_TOKEN / HF_TOKEN_PATH) has not been granted access: accept the model's license "
               f"at {url} with that account"
               if token_set else
               f"accept its license at {url}, then give a token with access: HF_TOKEN (or HF_TOKEN_PATH; in the "
               "chart hfTokenSecret)")
        return ModelError(f"Hugging Face model {spec.repo_id!r} is gated: {fix}")
    if isinstance(e, E.RevisionNotFoundError):
        return UnknownModel(f"Hugging Face model {spec.repo_id!r} has no revision {spec.ref!r} (not a branch, tag or "
                            f"commit of {url}); check the revision (--revision / @rev)")
    if isinstance(e, E.RepositoryNotFoundError):
        auth = ("(HF_TOKEN is set, so it does not exist or the token cannot see it)" if token_set else
                "(if it is private, set HF_TOKEN to a token that can read it)")
        return UnknownModel(f"unknown Hugging Face model {spec.repo_id!r}: no such repository on the Hub {auth}; "
                            "check the id (org/name)")
    if isinstance(e, E.DisabledRepoError):
        return ModelError(f"Hugging Face model {spec.repo_id!r} has been disabled on the Hub; pick another model")
    if isinstance(e, E.IncompleteSnapshotError):
        return ModelError(f"the cached snapshot of Hugging Face model {str(spec)!r} is incomplete (an interrupted "
                          f"download?) and the Hub could not be reached to finish it: {e}")
    if isinstance(e, E.LocalEntryNotFoundError):
        return _offline_error(spec)
    if isinstance(e, (E.OfflineModeIsEnabled, ConnectionError, TimeoutError)):
        return _offline_error(spec, f"the Hub could not be reached: {type(e).__name__}")
    if isinstance(e, E.HFValidationError):
        return UnknownModel(f"{str(spec)!r} is not a valid Hugging Face model id: {e}")
    if isinstance(e, E.HfHubHTTPError):
        return ModelError(f"the Hub refused Hugging Face model {str(spec)!r}: {e}")
    return ModelError(f"could not fetch Hugging Face model {str(spec)!r}: {type(e).__name__}: {e}")


def _allow_patterns(files: list[str] | None, *, weights: bool, trust_remote_code: bool,
                    gguf: str | None = None) -> list[str]:
    if gguf is not None:  # the GGUF carries the config and the tokenizer: nothing else is needed
        return [glob.escape(gguf)]
    pats = CONFIG_PATTERNS + TOKENIZER_PATTERNS
    if weights:
        has_st = files is None or any(f.endswith(".safetensors") for f in files)
        pats = pats + (SAFETENSORS_PATTERNS if has_st else BIN_PATTERNS)
    if trust_remote_code:
        pats = pats + ["*.py"]
    return pats


def _ignore_patterns(gguf: str | None) -> list[str]:
    return [p for p in IGNORE_PATTERNS if p != "*.gguf"] if gguf is not None else IGNORE_PATTERNS


def _cached_gguf(spec: HubSpec, snap: Path) -> tuple[bool, str | None]:
    """(whether the snapshot holds what ``spec`` loads, the GGUF it loads or None), from the cache
    alone; an ambiguous or missing GGUF reads as not held (the Hub's listing then decides)."""
    try:
        gguf = choose_gguf(spec, snapshot_files(snap), cached=True)
    except InvalidArgument:
        return False, None
    return (gguf is not None or not spec.names_gguf), gguf


def fetch(spec: HubSpec, *, weights: bool = True, trust_remote_code: bool = False,
          token: str | None = None, progress: bool = False) -> tuple[str, Path]:
    """(commit hash, snapshot dir) of ``spec``: :func:`fetch_files` without the GGUF's name."""
    commit, snap, _gguf = fetch_files(spec, weights=weights, trust_remote_code=trust_remote_code, token=token,
                                      progress=progress)
    return commit, snap


def fetch_files(spec: HubSpec, *, weights: bool = True, trust_remote_code: bool = False,
                token: str | None = None, progress: bool = False) -> tuple[str, Path, str | None]:
    """(commit hash, snapshot dir, GGUF path in it or None) of ``spec``, downloading what is missing
    unless offline. The GGUF is :func:`choose_gguf`'s pick from the repo's listing (online) or the
    snapshot (offline); with one, ``weights=False`` still fetches it (it holds the tokenizer).

    Offline (HF_HUB_OFFLINE): the cache only; a snapshot without weights (a tokenizer-only
    download) is an error when ``weights``.
    """
    hit = cached_snapshot(spec)
    if is_offline():
        return _fetch_offline(spec, hit, weights=weights, trust_remote_code=trust_remote_code)
    return _fetch_online(spec, hit, weights=weights, trust_remote_code=trust_remote_code, token=token,
                         progress=progress)


def _fetch_offline(spec: HubSpec, hit: tuple[str, Path] | None, *, weights: bool,
                   trust_remote_code: bool) -> tuple[str, Path, str | None]:
    """:func:`fetch_files` from the cache alone; ``hit`` is :func:`cached_snapshot`'s answer."""
    from huggingface_hub import snapshot_download

    E = _hub_errors()
    files = snapshot_files(hit[1]) if hit is not None else None
    gguf = choose_gguf(spec, files, cached=True) if files is not None else None
    if hit is not None and gguf is None and weights and not has_weights(hit[1]):
        raise ModelError(f"the cache holds only the tokenizer/config of Hugging Face model {str(spec)!r} "
                         f"({hit[1]}: no *.safetensors, *.bin or *.gguf); {_download_hint(spec)}")
    try:  # huggingface_hub's own resolution: refs/<branch or tag> -> snapshots/<commit>, checked
        # complete against the file listing cached at download time (for the files we fetch)
        snap = Path(snapshot_download(spec.repo_id, revision=spec.revision, cache_dir=str(hub_cache_dir()),
                                      local_files_only=True, ignore_patterns=_ignore_patterns(gguf),
                                      allow_patterns=_allow_patterns(files, weights=weights,
                                                                     trust_remote_code=trust_remote_code,
                                                                     gguf=gguf)))
    except E.IncompleteSnapshotError as e:
        raise ModelError(f"the cached snapshot of Hugging Face model {str(spec)!r} is incomplete (an interrupted "
                         f"download?): {e}; {_download_hint(spec)}") from e
    except E.LocalEntryNotFoundError as e:
        raise _offline_error(spec) from e
    except E.HFValidationError as e:
        raise translate_error(spec, e) from e
    commit = snap.name
    if gguf is not None:
        return commit, snap, gguf
    if not (snap / "config.json").is_file() and weights:
        raise ModelError(f"the cached snapshot {snap} of Hugging Face model {str(spec)!r} has no config.json; "
                         f"{_download_hint(spec)}")
    if weights and not has_weights(snap):
        raise ModelError(f"the cache holds only the tokenizer/config of Hugging Face model {str(spec)!r} "
                         f"({snap}: no *.safetensors or *.bin); {_download_hint(spec)}")
    return commit, snap, None


def _fetch_online(spec: HubSpec, hit: tuple[str, Path] | None, *, weights: bool, trust_remote_code: bool,
                  token: str | None, progress: bool) -> tuple[str, Path, str | None]:
    """:func:`fetch_files` through the Hub; a complete cached ``hit`` serves a commit hash without asking
    the Hub, and serves any revision when the Hub cannot be reached."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    E = _hub_errors()

    def cached_if_complete() -> tuple[str, Path, str | None] | None:
        if hit is None:
            return None
        held, gguf = _cached_gguf(spec, hit[1])
        if held and (gguf is not None or not weights or has_weights(hit[1])):
            return hit[0], hit[1], gguf
        return None

    if COMMIT_HASH.match(spec.ref) and (done := cached_if_complete()) is not None:
        return done  # a commit never changes: nothing to ask the Hub
    bars_were_off = are_progress_bars_disabled()
    if not progress:
        disable_progress_bars()
    try:
        endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, like the cache and the offline switch
        info = HfApi(token=token, endpoint=endpoint).model_info(spec.repo_id, revision=spec.revision)
        files = [s.rfilename for s in (info.siblings or [])]
        gguf = choose_gguf(spec, files)
        path = snapshot_download(spec.repo_id, revision=spec.revision, cache_dir=str(hub_cache_dir()), token=token,
                                 endpoint=endpoint,
                                 allow_patterns=_allow_patterns(files, weights=weights,
                                                                trust_remote_code=trust_remote_code, gguf=gguf),
                                 ignore_patterns=_ignore_patterns(gguf))
    except (E.RepositoryNotFoundError, E.RevisionNotFoundError, E.LocalEntryNotFoundError, E.HfHubHTTPError,
            E.OfflineModeIsEnabled, E.HFValidationError, E.DisabledRepoError) as e:
        raise translate_error(spec, e) from e
    except (ConnectionError, TimeoutError, OSError) as e:
        if (done := cached_if_complete()) is not None:
            return done  # the Hub is unreachable but the cache has this revision
        raise translate_error(spec, e) from e
    except InvalidArgument:
        raise
    except Exception as e:  # httpx's connection errors are not ConnectionError subclasses
        if type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            if (done := cached_if_complete()) is not None:
                return done
            raise _offline_error(spec, f"the Hub could not be reached: {type(e).__name__}: {e}") from e
        raise translate_error(spec, e) from e
    finally:
        if not progress and not bars_were_off:
            enable_progress_bars()
    snap = Path(path)
    return snap.name, snap, gguf
