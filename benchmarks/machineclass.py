"""The machine class a benchmark result is filed under (benchmarks/results/<name>-<class>.json).

Results are only comparable within a class: amx (Intel with AMX), epyc (AMD with AVX512-BF16),
avx2 (a plain AVX2 CPU), or the GPU's short name (h100, h200, ...) when CUDA is present.
"""

from __future__ import annotations

import re

CPU_CLASSES = ("amx", "epyc", "avx2")


def cpu_class(cpuinfo: str) -> str:
    """The class of a CPU from the text of /proc/cpuinfo."""
    flags = set()
    vendor = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and not flags:
            flags = set(value.split())
        elif key.strip() == "vendor_id" and not vendor:
            vendor = value.strip()
    if "amx_bf16" in flags:
        return "amx"
    if vendor == "AuthenticAMD" and "avx512_bf16" in flags:
        return "epyc"
    return "avx2" if "avx2" in flags else "cpu"


def gpu_class(device_name: str) -> str:
    """The short name of a GPU ("NVIDIA H200" -> h200, "NVIDIA H100 80GB HBM3" -> h100)."""
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", device_name.lower().replace("nvidia", ""))
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "", device_name.lower()) or "gpu"


def machine_class() -> str:
    """This machine's class: the GPU's when CUDA is available, else the CPU's."""
    try:
        import torch

        if torch.cuda.is_available():
            return gpu_class(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_class(f.read())
    except OSError:
        return "cpu"


def result_name(tag: str, cls: str | None = None) -> str:
    """The file stem a result is written under: the tag, ending in the machine class (added when the
    tag does not already end in it)."""
    cls = cls or machine_class()
    return tag if tag.endswith(f"-{cls}") else f"{tag}-{cls}"
