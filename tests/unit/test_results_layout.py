"""benchmarks/results/ holds the current result per benchmark, variant and machine class, named
`<benchmark>-<variant>-<machineclass>.{json,png,md}`; earlier results live in git, not in file
names. These tests keep it that way: no commit hash in a name, every result file named by its
machine class (two known exceptions), and every results file the READMEs and docs link to exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CLASSES = ("amx", "epyc", "avx2", "h200")
# soak.json is written under that name by `make soak`; cpu-qwen1.5b is from an Intel Xeon with
# AVX512 and no bf16, a machine class not used since 2026-11-30 (results README).
UNCLASSED = {"soak.json", "soak.png", "cpu-qwen1.5b.json", "cpu-qwen1.5b.md"}
NAME = re.compile(r"^[a-z0-9][a-z0-9.]*(-[a-z0-9.]+)*-(%s)\.(json|png|md)$" % "|".join(CLASSES))
HASH = re.compile(r"(^|-)(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(-|\.)")


def _result_files():
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file() and p.name not in ("README.md", "notes.md"))


def test_result_names_carry_no_commit_hash():
    assert [n for n in _result_files() if HASH.search(n)] == []


def test_result_names_end_in_a_machine_class():
    assert [n for n in _result_files() if n not in UNCLASSED and not NAME.match(n)] == []


def test_every_result_file_the_results_readme_names_exists():
    text = (RESULTS / "README.md").read_text()
    files = set(_result_files())
    named = set(re.findall(r"`([a-z0-9][a-z0-9.-]*-(?:%s))`" % "|".join(CLASSES), text))
    named |= set(re.findall(r"[a-z0-9][a-z0-9_.-]*\.(?:json|png|md)\b", text))
    named -= {"design.md", "services.md", "notes.md", "gpu_verify_batch.json"}
    missing = [n for n in sorted(named) if n not in files and not any(f.startswith(n + ".") for f in files)]
    assert missing == []
    described = [f for f in files if f.rsplit(".", 1)[0] not in text]
    assert described == []


def test_links_into_results_from_the_docs_exist():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"\]\(benchmarks/results/([^)#]+)\)", doc.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{doc.name}: {name}")
        for name in re.findall(r"`benchmarks/results/([A-Za-z0-9._-]+\.(?:json|png|md))`", doc.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{doc.name}: {name}")
    assert missing == []
