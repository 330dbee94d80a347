"""benchmarks/results/ holds the current result per benchmark, variant and machine class: a JSON named
`<benchmark>-<variant>-<machineclass>.json`, stamped with the commit and the machine it measured, and
beside it a plot (`.png`) or the script's table (`.md`) of the same name. Earlier results live in git,
not in file names. These tests keep it that way: no commit hash in a name, every name ends in a
machine class (soak's is the one exception), every JSON is stamped, the results README lists every
result with the commit its JSON holds, and every results file a README or doc links to exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
CLASSES = ("amx", "epyc", "avx2", "h200")
# `make soak` writes soak.json / soak.png under that name (tiny models on whatever machine runs it).
UNCLASSED = {"soak.json", "soak.png"}
NAME = re.compile(r"^[a-z0-9][a-z0-9.]*(-[a-z0-9.]+)*-(%s)\.(json|png|md)$" % "|".join(CLASSES))
HASH = re.compile(r"(^|-)(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(-|\.)")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
# the results README's table: | `file` | script | what | commit | result |
ROW = re.compile(r"^\| `([a-z0-9][a-z0-9.-]*)` \|[^|]*\|[^|]*\| ([0-9a-f]{7,40}) \|", re.M)


def _result_files(folder: Path = RESULTS) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "README.md")


def _stamp(path: Path) -> tuple[str | None, str | None, bool]:
    """(commit, machine, dirty) of a result JSON: bench scripts write them under `meta`, the GPU
    checks at the top level."""
    data = json.loads(path.read_text())
    meta = data.get("meta", {})
    commit = meta.get("commit") or data.get("commit")
    machine = meta.get("cpu") or meta.get("machine") or data.get("device")
    return commit, machine, bool(meta.get("dirty"))


def layout_problems(folder: Path) -> list[str]:
    """What breaks the layout in `folder`: names, stamps, and files without their JSON."""
    files = _result_files(folder)
    problems = [f"commit in name: {n}" for n in files if HASH.search(n)]
    problems += [f"no machine class: {n}" for n in files if n not in UNCLASSED and not NAME.match(n)]
    problems += [f"not a result: {n}" for n in files if not n.endswith((".json", ".png", ".md"))]
    stems = {n[:-5] for n in files if n.endswith(".json")}
    problems += [f"no JSON beside: {n}" for n in files
                 if n.endswith((".png", ".md")) and n.rsplit(".", 1)[0] not in stems]
    for n in files:
        if n.endswith(".json"):
            commit, machine, dirty = _stamp(folder / n)
            if not (isinstance(commit, str) and COMMIT.match(commit)) or dirty:
                problems.append(f"not stamped with a clean commit: {n}")
            if not machine:
                problems.append(f"not stamped with a machine: {n}")
    return problems


def test_the_results_folder_keeps_its_layout():
    assert layout_problems(RESULTS) == []


def test_at_most_40_files():
    assert len([p for p in RESULTS.iterdir() if p.is_file()]) <= 40


@pytest.mark.parametrize("name, content, problem", [
    ("bench-qwen1.5b-2dbe1a9.json", {"meta": {"commit": "2dbe1a9", "cpu": "x"}}, "commit in name"),
    ("bench-qwen1.5b.json", {"meta": {"commit": "2dbe1a9", "cpu": "x"}}, "no machine class"),
    ("bench-qwen1.5b-amx.json", {"meta": {"cpu": "x"}}, "not stamped with a clean commit"),
    ("bench-qwen1.5b-amx.json", {"meta": {"commit": "2dbe1a9", "dirty": True, "cpu": "x"}}, "clean commit"),
    ("bench-qwen1.5b-amx.json", {"meta": {"commit": "2dbe1a9"}}, "not stamped with a machine"),
    ("bench-qwen1.5b-amx.png", None, "no JSON beside"),
])
def test_the_layout_check_finds_what_breaks_it(tmp_path, name, content, problem):
    (tmp_path / name).write_text(json.dumps(content) if content is not None else "")
    assert any(problem in p for p in layout_problems(tmp_path))
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "bench-qwen1.5b-amx.json").write_text(json.dumps({"meta": {"commit": "2dbe1a9", "cpu": "x"}}))
    (ok / "bench-qwen1.5b-amx.png").write_text("")
    assert layout_problems(ok) == []


def test_the_results_readme_lists_every_result_with_the_commit_it_measured():
    text = (RESULTS / "README.md").read_text()
    rows = dict(ROW.findall(text))
    stems = sorted({n.rsplit(".", 1)[0] for n in _result_files()})
    assert sorted(rows) == stems
    wrong = []
    for stem, commit in rows.items():
        measured, _, _ = _stamp(RESULTS / f"{stem}.json")
        if not measured.startswith(commit):
            wrong.append(f"{stem}: README {commit}, JSON {measured}")
    assert wrong == []


def test_every_result_the_results_readme_names_exists():
    text = (RESULTS / "README.md").read_text()
    files = set(_result_files())
    named = set(re.findall(r"`([a-z0-9][a-z0-9.-]*-(?:%s))`" % "|".join(CLASSES), text))
    named |= set(re.findall(r"--tag ([a-z0-9][a-z0-9.-]*-(?:%s))\b" % "|".join(CLASSES), text))
    missing = [n for n in sorted(named) if not any(f.startswith(n + ".") for f in files)]
    assert missing == []


def test_links_into_results_from_the_docs_exist():
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"\]\((?:\.\./)?benchmarks/results/([^)#]+)\)", doc.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{doc.name}: {name}")
        for name in re.findall(r"`?benchmarks/results/([A-Za-z0-9._-]+\.(?:json|png|md))`?", doc.read_text()):
            if not (RESULTS / name).exists():
                missing.append(f"{doc.name}: {name}")
    assert missing == []
