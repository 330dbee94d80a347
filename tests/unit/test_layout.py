"""The services never import each other (docs/layout.md), and the core modules of crossdraft import
no gRPC server, Redis or web-framework code."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("drafter", "verifier", "gateway")
# The modules of crossdraft/ that speak to the network or start processes; every other module is core
# (decoding, models, batching, the KV pool, ...), so a new module is held to the core rule by default.
EDGE = {
    "cli": "the command line starts and calls services",
    "client": "a gRPC client of the gateway",
    "redis_server": "starts a Redis server and talks to it",
    "rpc": "the model servers' gRPC servicers",
    "tls": "gRPC channel and server credentials",
    "up": "starts the whole stack",
}
CORE = tuple(sorted(p.stem for p in (ROOT / "crossdraft").glob("*.py") if p.stem not in EDGE and p.stem != "__init__"))


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


def test_every_edge_module_exists():
    missing = [name for name in EDGE if not (ROOT / "crossdraft" / f"{name}.py").exists()]
    assert not missing, f"EDGE names modules that are gone: {missing}"
    assert len(CORE) > 20  # the glob found the package


def test_core_modules_import_no_server_redis_or_web_code():
    banned = {"grpc", "redis", "starlette", "uvicorn", "drafter", "verifier", "gateway"}
    for name in CORE:
        f = ROOT / "crossdraft" / f"{name}.py"
        bad = imported_modules(f) & banned
        assert not bad, f"crossdraft/{name}.py imports {bad}"


PACKAGES = ("crossdraft", "gateway", "drafter", "verifier")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node) -> bool:
    t = node.test
    return ((isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
            or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def _runtime_imports(tree) -> list:
    """Import nodes anywhere in the module (top level and deferred, inside functions), except
    those under ``if TYPE_CHECKING:`` (never executed)."""
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the repo modules it imports (generated gRPC stubs left out)."""
    files = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if "v1" in f.relative_to(ROOT).parts:
                continue
            files[_module_name(f)] = f
    known = set(files)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, f in files.items():
        is_pkg = f.name == "__init__.py"
        base = mod.split(".") if is_pkg else mod.split(".")[:-1]
        for node in _runtime_imports(ast.parse(f.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    anchor = base[: len(base) - (node.level - 1)]
                    prefix = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                targets = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t and t != mod and t not in PACKAGES:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack: list[str] = []

    def dfs(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == GREY:
                return stack[stack.index(n):] + [n]
            if color[n] == WHITE:
                c = dfs(n)
                if c:
                    return c
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            c = dfs(m)
            if c:
                return c
    return None


def test_no_import_cycle_in_the_repo_packages():
    graph = import_graph()
    assert "crossdraft.sessions" in graph["crossdraft.workers"]  # the graph sees real edges
    assert "crossdraft.decode" in graph["crossdraft.engine"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_sees_deferred_imports():
    # a deferred import (inside a function) closing a loop counts as a cycle
    src = {"a": "import b\n", "b": "def f():\n    from a import x\n"}
    graph = {}
    for mod, text in src.items():
        graph[mod] = set()
        for node in _runtime_imports(ast.parse(text)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            graph[mod].update(n for n in names if n in src)
    assert find_cycle(graph) == ["a", "b", "a"]
    guarded = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import b\n")
    assert [type(n).__name__ for n in _runtime_imports(guarded)] == ["ImportFrom"]


def test_layering_runs_one_way():
    graph = import_graph()
    # engine -> decode -> workers -> sessions -> sampling; nothing below imports upward
    order = ["crossdraft.engine", "crossdraft.decode", "crossdraft.workers", "crossdraft.sessions",
             "crossdraft.sampling"]
    for i, low in enumerate(order):
        for high in order[:i]:
            assert high not in graph[low], f"{low} imports {high}"


def test_ports_are_stated_and_the_adapters_conform():
    import inspect

    from crossdraft.ports import DrafterPort, VerifierPort
    from crossdraft.workers import DrafterWorker, VerifierWorker
    from gateway.clients import RemoteDrafter, RemoteVerifier

    for port, impls in ((VerifierPort, (VerifierWorker, RemoteVerifier)),
                        (DrafterPort, (DrafterWorker, RemoteDrafter))):
        methods = [n for n, v in vars(port).items() if callable(v) and not n.startswith("_")]
        methods += [n for base in port.__mro__[1:] if base.__name__.endswith("Port")
                    for n, v in vars(base).items() if callable(v) and not n.startswith("_")]
        assert "sync" in methods and "end" in methods
        for impl in impls:
            assert issubclass(impl, port), f"{impl.__name__} does not conform to {port.__name__}"
            for name in methods:
                want = list(inspect.signature(getattr(port, name)).parameters)
                have = list(inspect.signature(getattr(impl, name)).parameters)
                assert have[: len(want)] == want, f"{impl.__name__}.{name}{have} vs {port.__name__}.{name}{want}"
