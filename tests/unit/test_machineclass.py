"""benchmarks/machineclass.py: a benchmark's result is filed under the machine class it ran on, read
from /proc/cpuinfo's text (or the GPU's name), so `make bench` and friends write names that
benchmarks/results/ accepts (tests/unit/test_results_layout.py)."""

from __future__ import annotations

from benchmarks.machineclass import cpu_class, gpu_class, result_name
from tests.unit.test_results_layout import NAME


def _cpuinfo(vendor: str, flags: str) -> str:
    return f"processor\t: 0\nvendor_id\t: {vendor}\nmodel name\t: x\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n"


def test_cpu_classes_follow_the_flags_that_decide_bf16_and_fp32_speed():
    assert cpu_class(_cpuinfo("GenuineIntel", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile")) == "amx"
    assert cpu_class(_cpuinfo("AuthenticAMD", "avx2 avx512f avx512_bf16")) == "epyc"
    assert cpu_class(_cpuinfo("GenuineIntel", "avx2 avx512f avx512_bf16")) == "avx2"  # no AMX: bf16 is not native
    assert cpu_class(_cpuinfo("AuthenticAMD", "avx2")) == "avx2"
    assert cpu_class(_cpuinfo("GenuineIntel", "sse4_2")) == "cpu"


def test_gpu_classes_are_the_short_names():
    assert gpu_class("NVIDIA H200") == "h200"
    assert gpu_class("NVIDIA H100 80GB HBM3") == "h100"


def test_a_tag_gets_the_class_once_and_the_name_fits_the_results_layout():
    assert result_name("services", "amx") == "services-amx"
    assert result_name("bench-smoke-amx", "amx") == "bench-smoke-amx"
    assert result_name("bench-smoke-epyc", "amx") == "bench-smoke-epyc-amx"  # another machine's tag is a variant
    for cls in ("amx", "epyc", "avx2", "h200"):
        assert NAME.match(result_name("health-under-load", cls) + ".json")
