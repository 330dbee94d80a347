"""The repository's layout, as docs/layout.md states it: crossdraft is a few packages by concept in
layers, imports run from a higher layer to a lower one only, the services never import each other,
and nothing forms an import cycle (deferred imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("drafter", "verifier", "gateway")
# crossdraft's layers, lowest first; a module may import its own layer and those below it. The
# modules directly under crossdraft/ are the base (what every layer shares) or the top (the entry
# points users import); a new module there must be named here, a new package must get a layer.
BASE = {"errors", "argtypes", "home"}
TOP = {"engine", "cli", "client"}
LAYERS = ("base", "vocab", "decoding", "models", "runtime", "serving", "top")
# what a service may import of crossdraft: the gateway speaks to model servers and maps vocabularies,
# it never runs a model; the model servers reach the runtime only through serving's modelserver shell
SERVICE_MAY_IMPORT = {
    "gateway": {"base", "vocab", "decoding", "models", "serving"},
    "drafter": {"base", "serving"},
    "verifier": {"base", "serving"},
}
# third-party code that a layer must not import (the model-side layers are free of any transport)
BANNED = {
    "vocab": {"grpc", "redis", "starlette", "uvicorn", "torch"},
    "decoding": {"grpc", "redis", "starlette", "uvicorn", "transformers"},
    "models": {"grpc", "redis", "starlette", "uvicorn"},
    "runtime": {"grpc", "redis", "starlette", "uvicorn"},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name under crossdraft (``crossdraft.decoding.policy`` -> decoding)."""
    parts = module.split(".")
    assert parts[0] == "crossdraft", module
    if len(parts) == 1:
        return "top"
    if parts[1] in BASE:
        return "base"
    if parts[1] in TOP:
        return "top"
    return parts[1]


def crossdraft_modules() -> dict[str, Path]:
    return {m: f for m, f in repo_modules().items() if m.split(".")[0] == "crossdraft"}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of everything a file imports (deferred imports included)."""
    mods = set()
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods.update(a.name.split(".")[0] for a in node.names)
        elif node.level == 0 and node.module:
            mods.add(node.module.split(".")[0])
    return mods


def test_services_do_not_import_each_other():
    for svc in SERVICES:
        files = list((ROOT / svc).glob("*.py"))
        assert files
        for f in files:
            others = imported_modules(f) & (set(SERVICES) - {svc})
            assert not others, f"{f.relative_to(ROOT)} imports {others}"


def test_every_module_of_crossdraft_has_a_layer():
    mods = crossdraft_modules()
    assert "crossdraft.decoding.decode" in mods and "crossdraft.runtime.workers" in mods  # the walk sees them
    for mod in mods:
        assert layer_of(mod) in LAYERS, f"{mod}: a package without a layer (add it to LAYERS and docs/layout.md)"
    flat = sorted(p.stem for p in (ROOT / "crossdraft").glob("*.py") if p.stem != "__init__")
    stray = set(flat) - BASE - TOP
    assert not stray, f"modules directly under crossdraft/ that are neither base nor top: {stray}"
    assert len(flat) <= 8, flat
    for pkg in {layer_of(m) for m in mods} - {"base", "top"}:
        init = ROOT / "crossdraft" / pkg / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "import" in doc, f"crossdraft/{pkg}/__init__.py must say what the package is and may import"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge of the graph that breaks the layers: crossdraft importing upward or importing a
    service, a service importing a layer it may not."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        for dep in deps:
            dtop = dep.split(".")[0]
            if top == "crossdraft" and dtop in SERVICES:
                bad.append(f"{mod} imports the service {dep}")
            elif top == "crossdraft" and dtop == "crossdraft" and rank[layer_of(dep)] > rank[layer_of(mod)]:
                bad.append(f"{mod} ({layer_of(mod)}) imports {dep} ({layer_of(dep)}), a higher layer")
            elif top in SERVICES and dtop == "crossdraft" and layer_of(dep) not in SERVICE_MAY_IMPORT[top]:
                bad.append(f"{mod} imports {dep} ({layer_of(dep)})")
    return bad


def test_imports_run_from_a_higher_layer_to_a_lower_one():
    bad = upward_imports(import_graph())
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_upward_and_service_imports():
    ok = {"crossdraft.runtime.workers": {"crossdraft.decoding.sampling", "crossdraft.errors"},
          "gateway.core": {"crossdraft.decoding.decode", "crossdraft.serving.rpc"}}
    assert upward_imports(ok) == []
    assert len(upward_imports({**ok, "crossdraft.decoding.decode": {"crossdraft.runtime.workers"}})) == 1
    assert len(upward_imports({**ok, "crossdraft.vocab.mapping": {"crossdraft.models.catalog"}})) == 1
    assert len(upward_imports({**ok, "crossdraft.errors": {"gateway.core"}})) == 1
    assert len(upward_imports({**ok, "gateway.server": {"crossdraft.runtime.workers"}})) == 1
    assert len(upward_imports({**ok, "drafter.server": {"crossdraft.models.catalog"}})) == 1


def test_model_side_layers_import_no_transport_code():
    for mod, f in crossdraft_modules().items():
        bad = imported_modules(f) & BANNED.get(layer_of(mod), set())
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_imported_modules_sees_deferred_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    import grpc\n    from crossdraft.runtime import workers\n")
    assert imported_modules(f) == {"grpc", "crossdraft"}


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


def repo_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the four packages (generated gRPC stubs left out)."""
    files = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if "v1" in f.relative_to(ROOT).parts:
                continue
            files[_module_name(f)] = f
    return files


def import_graph() -> dict[str, set[str]]:
    """module -> the repo modules it imports (generated gRPC stubs left out)."""
    files = repo_modules()
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
    assert "crossdraft.runtime.sessions" in graph["crossdraft.runtime.workers"]  # the graph sees real edges
    assert "crossdraft.decoding.decode" in graph["crossdraft.engine"]
    assert "crossdraft.runtime.workers" in graph["crossdraft.serving.modelserver"]  # deferred imports too
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


def test_ports_are_stated_and_the_adapters_conform():
    import inspect

    from crossdraft.decoding.ports import DrafterPort, VerifierPort
    from crossdraft.runtime.workers import DrafterWorker, VerifierWorker
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


MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def long_code(files: dict[str, Path]) -> list[str]:
    """Modules over MAX_MODULE_LINES lines, and functions over MAX_FUNCTION_LINES lines without a comment
    line right above them (above their decorators) saying why they stay whole."""
    bad = []
    for mod, f in files.items():
        lines = f.read_text().splitlines()
        if len(lines) > MAX_MODULE_LINES:
            bad.append(f"{mod}: {len(lines)} lines")
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                above = lines[first - 2].strip() if first >= 2 else ""
                if length > MAX_FUNCTION_LINES and not above.startswith("#"):
                    bad.append(f"{mod}.{node.name}: {length} lines and no comment above it saying why")
    return bad


def test_modules_and_functions_stay_short():
    bad = long_code(repo_modules())
    assert not bad, "\n".join(bad)


def test_the_length_check_sees_long_modules_and_unexplained_long_functions(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    explained = tmp_path / "explained.py"
    explained.write_text(f"# one pass over shared state: kept whole\n@staticmethod\ndef f():\n{body}")
    bare = tmp_path / "bare.py"
    bare.write_text(f"x = 1\n\ndef g():\n{body}")
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_code({"explained": explained}) == []
    assert long_code({"bare": bare}) == [f"bare.g: {MAX_FUNCTION_LINES + 1} lines and no comment above it saying why"]
    assert long_code({"big": big}) == [f"big: {MAX_MODULE_LINES + 1} lines"]


def test_a_gateway_process_loads_no_model_runtime():
    # what a gateway pod imports at start: nothing of the runtime and no transformers (its tokenizers load later)
    import subprocess
    import sys

    code = ("import sys, gateway.server, gateway.core, gateway.rest, gateway.service; "
            "print(sorted(m for m in sys.modules if m.startswith('crossdraft.runtime') or m == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
