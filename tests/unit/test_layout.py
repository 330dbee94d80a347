"""The services never import each other (DESIGN.md §3), and the core modules of crossdraft import
no gRPC server, Redis or web-framework code."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("drafter", "verifier", "gateway")
CORE = ("sampling", "vocab", "engine", "decode", "workers", "models", "errors")


def imported_modules(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_services_do_not_import_each_other():
    for svc in SERVICES:
        files = list((ROOT / svc).glob("*.py"))
        assert files
        for f in files:
            others = imported_modules(f) & (set(SERVICES) - {svc})
            assert not others, f"{f.relative_to(ROOT)} imports {others}"


def test_core_modules_import_no_server_redis_or_web_code():
    banned = {"grpc", "redis", "starlette", "uvicorn", "drafter", "verifier", "gateway"}
    for name in CORE:
        f = ROOT / "crossdraft" / f"{name}.py"
        bad = imported_modules(f) & banned
        assert not bad, f"crossdraft/{name}.py imports {bad}"
