#!/usr/bin/env python3
"""Coverage per package (crossdraft, gateway, drafter, verifier) from `coverage json` output.

    scripts/coverage_table.py NEW.json [--before OLD.json] [--markdown]

Prints lines and branches covered per package (sums over the package's files), and with --before
the same for the older run beside it and the change in points. Exits 1 when a package covered a
smaller share of its lines or branches than before (by more than --slack points), so that a change
to the tests can be checked for lost coverage.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def per_package(path: Path) -> dict[str, dict[str, int]]:
    files = json.loads(path.read_text())["files"]
    out: dict[str, dict[str, int]] = {}
    for name, f in files.items():
        pkg = Path(name).parts[0]
        s = f["summary"]
        acc = out.setdefault(pkg, {"lines": 0, "lines_hit": 0, "branches": 0, "branches_hit": 0})
        acc["lines"] += s["num_statements"]
        acc["lines_hit"] += s["covered_lines"]
        acc["branches"] += s.get("num_branches", 0)
        acc["branches_hit"] += s.get("covered_branches", 0)
    return out


def pct(hit: int, total: int) -> float:
    return 100.0 * hit / total if total else 100.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("new", type=Path)
    ap.add_argument("--before", type=Path)
    ap.add_argument("--slack", type=float, default=0.05, help="points a package may lose before it counts (0.05)")
    args = ap.parse_args(argv)
    new = per_package(args.new)
    old = per_package(args.before) if args.before else {}
    head = "| package | lines | line % | branches | branch % |"
    if old:
        head += " line % before | branch % before | change (lines / branches) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    lost = []
    for pkg in sorted(set(new) | set(old)):
        n = new.get(pkg, {"lines": 0, "lines_hit": 0, "branches": 0, "branches_hit": 0})
        lp, bp = pct(n["lines_hit"], n["lines"]), pct(n["branches_hit"], n["branches"])
        row = f"| {pkg} | {n['lines']} | {lp:.1f} | {n['branches']} | {bp:.1f} |"
        if old:
            o = old.get(pkg, {"lines": 0, "lines_hit": 0, "branches": 0, "branches_hit": 0})
            olp, obp = pct(o["lines_hit"], o["lines"]), pct(o["branches_hit"], o["branches"])
            row += f" {olp:.1f} | {obp:.1f} | {lp - olp:+.1f} / {bp - obp:+.1f} |"
            if lp < olp - args.slack or bp < obp - args.slack:
                lost.append(pkg)
        print(row)
    if lost:
        print(f"coverage lost in: {', '.join(lost)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
