"""Models named by Hugging Face Hub id (crossdraft.models: hub, resolve, loading), offline.

The Hub is NOT reachable from the machines these tests run on. So:

- the offline paths run for real: a Hub cache laid out on disk the way huggingface_hub writes it
  (models--org--name/refs/main, snapshots/<commit>/ -> blobs/), holding tiny random-init models,
  with HF_HUB_OFFLINE=1 and HF_HOME / HF_HUB_CACHE pointing at it;
- the online failures (unknown repo, gated repo, unknown revision) are answered by a local
  stand-in for the Hub's HTTP API that replies as the Hub does (status code + X-Error-Code
  header), so huggingface_hub raises its own exception classes through its own code, and by
  huggingface_hub's exception classes raised directly where a reply cannot be staged.
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from crossdraft.errors import InvalidArgument, ModelError, UnknownModel
from crossdraft.models import hub
from crossdraft.models.loading import load_model
from crossdraft.models.resolve import resolve_model
from crossdraft.models.tokenizers import load_tokenizer
from tests.hub_fixtures import add_snapshot, fake_commit, gguf_sources, hub_env
from tests.service_fixtures import save_tiny_pair

ROOT = Path(__file__).resolve().parents[3]
T_REPO, D_REPO = "tiny-org/tiny-target", "tiny-org/tiny-drafter"
C1, C2, D1 = fake_commit("target-1"), fake_commit("target-2"), fake_commit("drafter-1")
# repos of GGUFs only: one GGUF; two quantisations (and a split one); a split one only
G_REPO, MULTI_REPO, SPLIT_REPO = "tiny-org/tiny-gguf", "tiny-org/multi-gguf", "tiny-org/split-gguf"
G1, M1, S1 = fake_commit("gguf-1"), fake_commit("multi-1"), fake_commit("split-1")
SPLIT_PARTS = ("tiny-F16-00001-of-00002.gguf", "tiny-F16-00002-of-00002.gguf")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """HF_HOME with a Hub cache: the target at two commits (main -> C2, tag v1 -> C1), the drafter at
    D1, and tokenizer-only snapshot of another repo (what `crossdraft vocab` leaves behind)."""
    root = tmp_path_factory.mktemp("hub")
    t_dir, d_dir = save_tiny_pair(root / "src")
    home = root / "hf"
    add_snapshot(home / "hub", T_REPO, t_dir, C1, refs=("v1",))
    add_snapshot(home / "hub", T_REPO, t_dir, C2, refs=("main",))
    add_snapshot(home / "hub", D_REPO, d_dir, D1)
    toks = tuple(p.name for p in t_dir.iterdir() if p.name.startswith("tokenizer") or p.name == "config.json")
    add_snapshot(home / "hub", "tiny-org/tokenizer-only", t_dir, fake_commit("tok"), only=toks)
    g = gguf_sources()
    add_snapshot(home / "hub", G_REPO, g, G1, only=("tiny-Q8_0.gguf", "README.md"))
    add_snapshot(home / "hub", MULTI_REPO, g, M1, refs=("main", "v1"))
    add_snapshot(home / "hub", SPLIT_REPO, g, S1, only=(*SPLIT_PARTS, "README.md"))
    return home


@pytest.fixture
def offline(hf_home, monkeypatch) -> Path:
    for k, v in hub_env(hf_home).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return hf_home


# ------------------------------------------------------------------------------------- spec parsing


@pytest.mark.parametrize("text,repo,rev", [
    ("org/name", "org/name", None),
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", None),
    ("meta-llama/Llama-3.1-8B-Instruct@main", "meta-llama/Llama-3.1-8B-Instruct", "main"),
    (f"org/name@{C1}", "org/name", C1),
    ("org/name@refs/pr/3", "org/name", "refs/pr/3"),
])
def test_parse_hub_spec(text, repo, rev):
    s = hub.parse_hub_spec(text)
    assert (s.repo_id, s.revision) == (repo, rev)
    assert str(s) == text


@pytest.mark.parametrize("text", ["name", "/abs/path", "./rel/path", "a/b/c", "org/na..me", "org/na--me", "org/",
                                  "org/name@", "org/name@a@b", "models/x.gguf/"])
def test_not_hub_ids(text):
    assert not hub.is_hub_id(text)


def test_revision_given_twice_must_agree():
    assert hub.parse_hub_spec("org/name@v1", "v1").revision == "v1"
    assert hub.parse_hub_spec("org/name", "v2").revision == "v2"
    with pytest.raises(InvalidArgument, match="revision"):
        hub.parse_hub_spec("org/name@v1", "v2")


def test_cache_dir_follows_env_now(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub.hub_cache_dir() == tmp_path / "c"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.is_offline()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    assert not hub.is_offline()


# ------------------------------------------------------------------------------------- resolving


def test_resolve_branch_tag_and_commit(offline):
    main = resolve_model(T_REPO)
    assert (main.kind, main.name, main.revision) == ("hub", T_REPO, C2)
    assert main.path == offline / "hub" / "models--tiny-org--tiny-target" / "snapshots" / C2
    assert resolve_model(f"{T_REPO}@v1").revision == C1
    assert resolve_model(T_REPO, revision="v1").revision == C1
    assert resolve_model(f"{T_REPO}@{C1}").revision == C1


def test_local_path_wins_over_hub_id(offline, tmp_path, monkeypatch):
    t_dir = offline / "hub" / "models--tiny-org--tiny-target" / "snapshots" / C1
    local = tmp_path / "tiny-org" / "tiny-target"
    local.mkdir(parents=True)
    for f in t_dir.iterdir():
        (local / f.name).write_bytes(f.read_bytes())
    monkeypatch.chdir(tmp_path)
    ref = resolve_model("tiny-org/tiny-target")
    assert ref.kind == "hf_dir" and ref.path == local.resolve() and ref.revision == ""
    with pytest.raises(InvalidArgument, match="local path"):
        resolve_model("tiny-org/tiny-target", revision="main")


def test_revision_of_a_catalog_model_is_refused():
    with pytest.raises(InvalidArgument, match="catalog"):
        resolve_model("smollm2-135m", revision="main")


def test_unknown_revision_offline_names_what_is_cached(offline):
    with pytest.raises(UnknownModel) as e:
        resolve_model(f"{T_REPO}@no-such-branch")
    msg = str(e.value)
    assert "no-such-branch" in msg and T_REPO in msg
    assert f"main -> {C2}" in msg and f"v1 -> {C1}" in msg  # what the cache does hold
    assert "crossdraft models download" in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(UnknownModel, match=fake_commit("never")):
        load_model(f"{T_REPO}@{fake_commit('never')}")


def test_uncached_id_offline(offline):
    with pytest.raises(ModelError) as e:
        resolve_model("nobody/uncached-model")
    msg = str(e.value)
    assert "'nobody/uncached-model'" in msg and "not in the cache" in msg and str(offline / "hub") in msg
    assert "crossdraft models download nobody/uncached-model" in msg
    with pytest.raises(ModelError, match="not in the cache"):
        load_tokenizer("nobody/uncached-model")


def test_tokenizer_only_snapshot(offline):
    tok = load_tokenizer("tiny-org/tokenizer-only")  # enough for `crossdraft vocab`
    assert len(tok) > 10
    with pytest.raises(ModelError, match="only the tokenizer"):
        load_model("tiny-org/tokenizer-only")


def test_unknown_spec_message_mentions_hub_ids():
    with pytest.raises(UnknownModel, match="Hugging Face Hub id"):
        resolve_model("not-a-catalog-name")


# ------------------------------------------------------------------------------------- loading


def test_load_model_from_hub_cache(offline):
    lm = load_model(T_REPO)
    assert (lm.kind, lm.name, lm.revision) == ("hub", T_REPO, C2)
    assert lm.vocab_size == lm.model.get_output_embeddings().weight.shape[0]
    pinned = load_model(f"{T_REPO}@{C1}")
    assert pinned.revision == C1
    assert load_model(T_REPO, revision="v1").revision == C1
    ids = lm.tokenizer("def add(a, b):")["input_ids"]
    assert ids == pinned.tokenizer("def add(a, b):")["input_ids"]


def test_trust_remote_code_is_off_unless_asked(offline, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    seen = []
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def spy_model(*a, **k):
        seen.append(("model", k.get("trust_remote_code", False)))
        return real_model(*a, **k)

    def spy_tok(*a, **k):
        seen.append(("tokenizer", k.get("trust_remote_code", False)))
        return real_tok(*a, **k)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy_tok)
    load_model(D_REPO)
    assert seen and all(flag is False for _, flag in seen)
    seen.clear()
    load_model(D_REPO, trust_remote_code=True)
    assert {kind for kind, flag in seen if flag is True} == {"model", "tokenizer"}


# ------------------------------------------------------------------------------------- online errors


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers /api/models/<org>/<name>[/revision/<rev>] the way huggingface.co does for the cases
    below (the real Hub is not reachable from here)."""

    def do_GET(self):  # noqa: N802
        path = self.path.split("?")[0]
        if path.startswith("/api/models/fake-org/gated"):
            return self._err(403, "GatedRepo", "Access to model fake-org/gated is restricted.")
        if path.startswith("/api/models/fake-org/missing"):
            return self._err(401, "RepoNotFound", "Repository not found")
        if path.startswith("/api/models/fake-org/real/revision/"):
            return self._err(404, "RevisionNotFound", "Invalid rev id: nope")
        return self._err(500, "", "unexpected request " + path)

    def _err(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """Online mode against a local stand-in of the Hub's API, with an empty cache."""
    import huggingface_hub.constants as C

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "no-token"))
    yield srv
    srv.shutdown()


def test_gated_repo_without_token(fake_hub):
    with pytest.raises(ModelError) as e:
        load_model("fake-org/gated")
    msg = str(e.value)
    assert "'fake-org/gated' is gated" in msg and "https://huggingface.co/fake-org/gated" in msg
    assert "HF_TOKEN" in msg and "hfTokenSecret" in msg
    assert not isinstance(e.value, UnknownModel)


def test_gated_repo_with_a_token_without_access(fake_hub, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    with pytest.raises(ModelError, match="has not been granted access"):
        load_tokenizer("fake-org/gated")


def test_unknown_repo_online(fake_hub):
    with pytest.raises(UnknownModel) as e:
        load_model("fake-org/missing")
    msg = str(e.value)
    assert "unknown Hugging Face model 'fake-org/missing'" in msg and "check the id" in msg and "HF_TOKEN" in msg


def test_unknown_revision_online(fake_hub):
    with pytest.raises(UnknownModel) as e:
        load_model("fake-org/real@nope")
    msg = str(e.value)
    assert "'fake-org/real' has no revision 'nope'" in msg and "--revision" in msg


def test_hub_unreachable_and_nothing_cached(monkeypatch, tmp_path):
    import socket

    import huggingface_hub.constants as C

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelError) as e:
        load_model("fake-org/anything")
    msg = str(e.value)
    assert "'fake-org/anything'" in msg and "could not be reached" in msg and "crossdraft models download" in msg


def test_hub_unreachable_but_cached_uses_the_cache(hf_home, monkeypatch):
    import socket

    import huggingface_hub.constants as C

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert load_tokenizer(T_REPO) is not None  # main -> C2 from the cache
    # a commit hash needs no Hub at all
    assert load_model(f"{D_REPO}@{D1}").revision == D1


@pytest.mark.parametrize("exc_name,cls,needle", [
    ("GatedRepoError", ModelError, "is gated"),
    ("RepositoryNotFoundError", UnknownModel, "no such repository"),
    ("RevisionNotFoundError", UnknownModel, "has no revision"),
    ("LocalEntryNotFoundError", ModelError, "not in the cache"),
    ("DisabledRepoError", ModelError, "disabled"),
])
def test_every_hub_exception_is_translated(exc_name, cls, needle, monkeypatch, tmp_path):
    """huggingface_hub's own exception classes, raised where the (unreachable) Hub would raise them."""
    import httpx2
    from huggingface_hub import errors as E

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    exc_cls = getattr(E, exc_name)
    if issubclass(exc_cls, E.HfHubHTTPError):
        resp = httpx2.Response(403, request=httpx2.Request("GET", "https://huggingface.co/api/models/o/n"))
        exc = exc_cls("from the Hub", response=resp)
    else:
        exc = exc_cls("from the Hub")

    def raise_it(*a, **k):
        raise exc

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", raise_it)
    with pytest.raises(cls, match=needle) as e:
        load_model("o/n@rev")
    assert "o/n" in str(e.value)


# ------------------------------------------------------------------------------------- the CLI


def _cli(args, env, timeout=300):
    full = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "crossdraft.cli", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_generate_and_vocab_by_hub_id(hf_home):
    env = hub_env(hf_home)
    r = _cli(["generate", "--target", T_REPO, "--drafter", f"{D_REPO}@{D1}", "--prompt", "def add(a, b):",
              "--max-new-tokens", "6", "--json", "--target-dtype", "float32", "--drafter-dtype", "float32"], env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["target_revision"], out["drafter_revision"]) == (C2, D1)
    assert len(out["token_ids"]) == 6
    r = _cli(["generate", "--target", T_REPO, "--target-revision", "v1", "--prompt", "x", "--max-new-tokens", "2",
              "--json", "--target-dtype", "float32"], env)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["target_revision"] == C1
    r = _cli(["vocab", "--target", f"{T_REPO}@{C1}", "--drafter", D_REPO, "--json"], env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["target"] == f"{T_REPO}@{C1}" and rep["drafter"] == D_REPO


def test_cli_errors_are_clear(hf_home):
    env = hub_env(hf_home)
    r = _cli(["generate", "--target", f"{T_REPO}@nope", "--prompt", "x"], env)
    assert r.returncode == 2 and "revision 'nope'" in r.stderr and "not in the cache" in r.stderr, r.stderr
    r = _cli(["vocab", "--target", "nobody/uncached", "--drafter", D_REPO], env)
    assert r.returncode == 2 and "'nobody/uncached' is not in the cache" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = _cli(["models", "download", T_REPO, "--revision", "v1"], env)  # offline: resolves from the cache
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith(f"{T_REPO}@{C1}")


# ------------------------------------------------------------------------------------- a download


class _ServingHub(http.server.BaseHTTPRequestHandler):
    """A stand-in for the Hub that serves one repo (``files``: name -> bytes) at ``commit``: the API
    calls huggingface_hub makes for a download (model info, the file tree) and the files."""

    repo = "fake-org/real"
    commit = fake_commit("served")
    files: dict[str, bytes] = {}
    requests: list[str] = []

    def _send(self, status, body=b"", headers=None, head=False):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _route(self, head=False):
        import hashlib

        path = self.path.split("?")[0]
        self.requests.append(f"{self.command} {path}")
        api = f"/api/models/{self.repo}"
        if path in (api, f"{api}/revision/main"):
            body = json.dumps({"id": self.repo, "modelId": self.repo, "sha": self.commit, "private": False,
                               "siblings": [{"rfilename": f} for f in sorted(self.files)]}).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        if path.startswith(f"{api}/tree/{self.commit}"):
            body = json.dumps([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                               for f, b in sorted(self.files.items())]).encode()
            return self._send(200, body, {"Content-Type": "application/json"}, head)
        prefix = f"/{self.repo}/resolve/{self.commit}/"
        if path.startswith(prefix) and path[len(prefix):] in self.files:
            data = self.files[path[len(prefix):]]
            etag = hashlib.sha256(data).hexdigest()
            return self._send(200, data, {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"',
                                          "Content-Type": "application/octet-stream"}, head)
        return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"}, head)

    def do_GET(self):  # noqa: N802
        self._route()

    def do_HEAD(self):  # noqa: N802
        self._route(head=True)

    def log_message(self, *args):
        pass


def test_download_then_offline(hf_home, monkeypatch, tmp_path):
    """The online path end to end against a local stand-in of the Hub (the real one is unreachable):
    one weights format and the tokenizer are fetched, nothing else; refs/main is written, so the same
    id then loads with HF_HUB_OFFLINE=1."""
    import huggingface_hub.constants as C

    src = hf_home / "hub" / "models--tiny-org--tiny-target" / "snapshots" / C1
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    files["pytorch_model.bin"] = b"not fetched: safetensors are there"
    files["model.onnx"] = b"not fetched"
    files["original/consolidated.pth"] = b"not fetched"
    files["modeling_custom.py"] = b"raise SystemExit('not fetched without trust_remote_code')"
    _ServingHub.files, _ServingHub.requests = files, []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ServingHub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        cache = tmp_path / "hf" / "hub"
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        assert resolve_model("fake-org/real").revision == ""  # not cached yet: resolved at load
        lm = load_model("fake-org/real")
        assert (lm.name, lm.revision) == ("fake-org/real", _ServingHub.commit)
        snap = cache / "models--fake-org--real" / "snapshots" / _ServingHub.commit
        got = {p.name for p in snap.rglob("*") if not p.is_dir()}
        assert "model.safetensors" in got and "config.json" in got and any(g.startswith("tokenizer") for g in got)
        assert not {"pytorch_model.bin", "model.onnx", "consolidated.pth", "modeling_custom.py"} & got
        assert (cache / "models--fake-org--real" / "refs" / "main").read_text() == _ServingHub.commit
        assert any(r.startswith("GET /fake-org/real/resolve/") for r in _ServingHub.requests)
    finally:
        srv.shutdown()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub is gone: the cache answers
    again = load_model("fake-org/real")
    assert again.revision == _ServingHub.commit
    # a file lost from the snapshot (an interrupted download): huggingface_hub's cached file listing says so
    (snap / "tokenizer_config.json").unlink()
    with pytest.raises(ModelError, match="incomplete"):
        load_model("fake-org/real")


# ------------------------------------------------------------------------------------- flags and env


def test_model_server_revision_flag_and_env(monkeypatch):
    import argparse

    from crossdraft.serving import modelserver

    def cfg(argv):
        p = argparse.ArgumentParser()
        modelserver.add_arguments(p, 50061)
        return modelserver.config_from_args(p.parse_args(argv))

    monkeypatch.delenv("CROSSDRAFT_REVISION", raising=False)
    monkeypatch.delenv("CROSSDRAFT_TRUST_REMOTE_CODE", raising=False)
    c = cfg(["--model", "org/name"])
    assert (c.revision, c.trust_remote_code) == (None, False)
    c = cfg(["--model", "org/name", "--revision", "v2", "--trust-remote-code"])
    assert (c.revision, c.trust_remote_code) == ("v2", True)
    monkeypatch.setenv("CROSSDRAFT_REVISION", C1)
    monkeypatch.setenv("CROSSDRAFT_TRUST_REMOTE_CODE", "true")
    c = cfg(["--model", "org/name"])
    assert (c.revision, c.trust_remote_code) == (C1, True)


def test_up_passes_revisions_to_the_model_servers():
    from crossdraft.serving.up import UpConfig, child_commands

    cmds = child_commands(UpConfig(target="org/t", drafter="org/d@main", target_revision="v1", trust_remote_code=True,
                                   redis_url="redis://127.0.0.1:1/0", http_port=1001, grpc_port=1002,
                                   drafter_port=1003, verifier_port=1004))
    v, d = cmds["verifier"], cmds["drafter"]
    assert v[v.index("--model") + 1] == "org/t" and v[v.index("--revision") + 1] == "v1"
    assert "--trust-remote-code" in v and "--trust-remote-code" in d
    assert d[d.index("--model") + 1] == "org/d@main" and "--revision" not in d


def test_pull_missing_false_uses_the_cache_only(hf_home, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online, but told not to download
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing there: a request would fail
    assert load_model(T_REPO, pull_missing=False).revision == C2
    with pytest.raises(ModelError, match="crossdraft models download nobody/else"):
        load_tokenizer("nobody/else", pull_missing=False)
    with pytest.raises(ModelError, match="not \\(completely\\) in the cache"):
        load_model("tiny-org/tokenizer-only", pull_missing=False)
    with pytest.raises(ModelError, match="'tiny-org/tiny-gguf:Q4_0' is not \\(completely\\) in the cache"):
        load_model(f"{G_REPO}:Q4_0", pull_missing=False)  # the snapshot holds the Q8_0 GGUF only
    assert load_model(G_REPO, pull_missing=False, progress=False, cpu_linear="plain").revision == G1


def test_cost_tables_of_the_test_models_stay_in_the_test_home(offline, monkeypatch):
    """A loaded model's forwards are timed once and the table cached under $CROSSDRAFT_HOME/costs;
    under hub_env that is the test's own home, so these tiny models never land in the user's cache."""
    from crossdraft.runtime import costs

    monkeypatch.setenv("CROSSDRAFT_COST_PROFILE", "measure")
    lm = load_model(T_REPO)
    assert costs.forward_ms(lm, 2)
    home = Path(os.environ["CROSSDRAFT_HOME"])
    assert home.is_relative_to(offline) and sorted((home / "costs").glob("*.json"))


# ------------------------------------------------------------------------------------- GGUF repos


@pytest.mark.parametrize("text,repo,rev,quant", [
    ("org/name:Q4_K_M", "org/name", None, "Q4_K_M"),
    ("org/name:q4_k_m@v1", "org/name", "v1", "q4_k_m"),
    (f"org/name@{C1}:IQ2_XXS", "org/name", C1, "IQ2_XXS"),
    ("org/name-GGUF:UD-Q4_K_XL", "org/name-GGUF", None, "UD-Q4_K_XL"),
])
def test_parse_quant_tag(text, repo, rev, quant):
    s = hub.parse_hub_spec(text)
    assert (s.repo_id, s.revision, s.quant, s.file) == (repo, rev, quant, None)
    assert hub.parse_hub_spec(str(s)) == s  # str() is org/name:QUANT[@rev]: it parses back


@pytest.mark.parametrize("text", ["org/name:", "org/name:a:b", "org/name:Q4@v1:Q8", "org/name:Q 4", "org:Q4/name"])
def test_not_hub_ids_with_tags(text):
    assert not hub.is_hub_id(text)


def test_model_file_is_checked_and_must_agree_with_the_tag():
    assert hub.parse_hub_spec("org/name", file="sub/m-Q4_0.gguf").file == "sub/m-Q4_0.gguf"
    assert hub.parse_hub_spec("org/name:q4_0", file="m-Q4_0.gguf").quant == "q4_0"
    for bad in ("/abs/m.gguf", "../m.gguf", "m.safetensors", "a b.gguf"):
        with pytest.raises(InvalidArgument, match="^model_file: .*not the path of a .gguf file"):
            hub.parse_hub_spec("org/name", file=bad)
    with pytest.raises(InvalidArgument, match="^model_file: 'm-Q8_0.gguf' does not carry .*'Q4_0'"):
        hub.parse_hub_spec("org/name:Q4_0", file="m-Q8_0.gguf")


def test_choose_gguf():
    spec = hub.parse_hub_spec
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q4_K_M_L.gguf", "m.Q8_0.gguf", "IQ4_K.gguf",
             "BF16/m-BF16-00001-of-00002.gguf", "BF16/m-BF16-00002-of-00002.gguf"]
    assert hub.choose_gguf(spec("o/n:q4_k_m"), files) == "m-Q4_K_M.gguf"  # a word of the name, any case
    assert hub.choose_gguf(spec("o/n:Q8_0"), files) == "m.Q8_0.gguf"
    assert hub.choose_gguf(spec("o/n:IQ4_K"), files) == "IQ4_K.gguf"
    assert hub.choose_gguf(spec("o/n", file="m-Q4_K_M_L.gguf"), files) == "m-Q4_K_M_L.gguf"
    with pytest.raises(InvalidArgument, match="^model: .*split into 2 files"):
        hub.choose_gguf(spec("o/n:BF16"), files)
    with pytest.raises(InvalidArgument, match="^model_file: .* holds 7 GGUF files: .*m-Q4_K_M.gguf.*--model-file"):
        hub.choose_gguf(spec("o/n"), files + ["m-Q4_K_M-L.gguf"][:0] + ["x.gguf"])
    with pytest.raises(InvalidArgument, match="^model: no GGUF .* carries the quantisation tag 'Q4_K'"):
        hub.choose_gguf(spec("o/n:Q4_K"), files)  # Q4_K_M is another tag
    with pytest.raises(InvalidArgument, match="^model: 2 GGUFs .*'Q5'"):
        hub.choose_gguf(spec("o/n:Q5"), ["a-Q5.gguf", "b-Q5.gguf"])
    # a repo with safetensors loads them unless a GGUF is named; one without GGUFs is not a GGUF repo
    assert hub.choose_gguf(spec("o/n"), ["model.safetensors", "m-Q4_0.gguf"]) is None
    assert hub.choose_gguf(spec("o/n:Q4_0"), ["model.safetensors", "m-Q4_0.gguf"]) == "m-Q4_0.gguf"
    assert hub.choose_gguf(spec("o/n"), ["config.json", "pytorch_model.bin"]) is None
    assert hub.choose_gguf(spec("o/n"), ["README.md", "only.gguf"]) == "only.gguf"


def _greedy(lm, prompt="def add(a, b):", n=12) -> list[int]:
    import torch

    ids = torch.tensor([lm.tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        return lm.model.generate(ids, max_new_tokens=n, do_sample=False)[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def local_gguf_greedy() -> dict[str, list[int]]:
    """Greedy tokens of each GGUF loaded from its local path: what every Hub spelling must give."""
    g = gguf_sources()
    return {q: _greedy(load_model(str(g / f"tiny-{q}.gguf"), progress=False, cpu_linear="plain"))
            for q in ("Q8_0", "Q4_0")}


def test_gguf_repo_loads_by_id(offline, local_gguf_greedy, caplog):
    import logging

    ref = resolve_model(G_REPO)
    assert (ref.kind, ref.revision, ref.gguf_file) == ("hub", G1, "tiny-Q8_0.gguf")
    with caplog.at_level(logging.INFO, logger="crossdraft.models.loading"):
        lm = load_model(G_REPO, progress=False, cpu_linear="plain")
    assert (lm.kind, lm.name, lm.revision) == ("hub", G_REPO, G1)
    assert lm.vocab_size == 400 and len(lm.tokenizer) == 400
    assert _greedy(lm) == local_gguf_greedy["Q8_0"]  # token-identical to the same GGUF from a local path
    assert local_gguf_greedy["Q8_0"] != local_gguf_greedy["Q4_0"]  # (the two quantisations do differ)
    assert any("tiny-Q8_0.gguf" in r.getMessage() and "dequantised to float32: " in r.getMessage()
               and "KiB" in r.getMessage() for r in caplog.records), caplog.text
    assert len(load_tokenizer(G_REPO)) == 400  # the tokenizer comes from the GGUF


def test_gguf_repo_by_tag_and_by_file(offline, local_gguf_greedy):
    by_tag = load_model(f"{MULTI_REPO}:q4_0", progress=False, cpu_linear="plain")  # any case
    assert (by_tag.revision, resolve_model(f"{MULTI_REPO}:q4_0").gguf_file) == (M1, "tiny-Q4_0.gguf")
    assert _greedy(by_tag) == local_gguf_greedy["Q4_0"]
    by_file = load_model(MULTI_REPO, model_file="tiny-Q8_0.gguf", revision="v1", progress=False,
                           cpu_linear="plain")
    assert by_file.revision == M1 and _greedy(by_file) == local_gguf_greedy["Q8_0"]
    assert resolve_model(f"{MULTI_REPO}:Q8_0@{M1}", model_file="tiny-Q8_0.gguf").gguf_file == "tiny-Q8_0.gguf"


def test_gguf_repo_errors(offline, tmp_path):
    with pytest.raises(InvalidArgument) as e:  # at resolve time: no loading
        resolve_model(MULTI_REPO)
    msg = str(e.value)
    assert e.value.field == "model_file" and "holds 4 GGUF files" in msg
    assert all(f in msg for f in ("tiny-Q4_0.gguf", "tiny-Q8_0.gguf", *SPLIT_PARTS))
    assert f"{MULTI_REPO}:<QUANT>" in msg and "--model-file" in msg
    with pytest.raises(InvalidArgument, match="holds 4 GGUF files"):
        load_model(MULTI_REPO)
    with pytest.raises(InvalidArgument, match="^model: no GGUF .*'Q5_K_M' .*tiny-Q4_0.gguf.*crossdraft models "
                                              "download tiny-org/multi-gguf:Q5_K_M"):
        load_model(f"{MULTI_REPO}:Q5_K_M")
    with pytest.raises(InvalidArgument, match="^model_file: .* has no file 'nope.gguf'.*--file nope.gguf"):
        load_tokenizer(MULTI_REPO, model_file="nope.gguf")
    for spec in (SPLIT_REPO, f"{MULTI_REPO}:F16"):
        with pytest.raises(InvalidArgument, match="part 1 of a GGUF split into 2 files .*gguf-split.*--merge"):
            load_model(spec)
    with pytest.raises(InvalidArgument, match="^model_file: .*local path"):
        resolve_model(str(gguf_sources() / "tiny-Q8_0.gguf"), model_file="tiny-Q4_0.gguf")
    with pytest.raises(InvalidArgument, match="^model_file: .*catalog model"):
        resolve_model("smollm2-135m", model_file="x.gguf")
    with pytest.raises(InvalidArgument, match="cached snapshot .*tiny-gguf:Q4_0.*holds tiny-Q8_0.gguf.*HF_HUB_OFFLINE"):
        load_model(f"{G_REPO}:Q4_0")


def test_gguf_repo_download_fetches_one_gguf(monkeypatch, tmp_path, local_gguf_greedy):
    """Online, against the stand-in Hub: the tagged GGUF and nothing else is downloaded; a repo of
    several GGUFs without a tag is refused from the Hub's listing, before any download."""
    import huggingface_hub.constants as C

    g = gguf_sources()
    _ServingHub.files = {p.name: p.read_bytes() for p in g.iterdir()}
    _ServingHub.files["Q4_0/tiny-Q4_0.gguf"] = _ServingHub.files.pop("tiny-Q4_0.gguf")  # a GGUF in a folder
    _ServingHub.requests = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ServingHub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
        monkeypatch.setattr(C, "HF_HUB_OFFLINE", False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        cache = tmp_path / "hf" / "hub"
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
        with pytest.raises(InvalidArgument, match="repo 'fake-org/real' holds 4 GGUF files"):
            load_model("fake-org/real")
        assert not any("/resolve/" in r for r in _ServingHub.requests)
        lm = load_model("fake-org/real:Q4_0", progress=False, cpu_linear="plain")
        assert lm.revision == _ServingHub.commit and _greedy(lm) == local_gguf_greedy["Q4_0"]
        snap = cache / "models--fake-org--real" / "snapshots" / _ServingHub.commit
        assert {str(p.relative_to(snap)) for p in snap.rglob("*") if not p.is_dir()} == {"Q4_0/tiny-Q4_0.gguf"}
    finally:
        srv.shutdown()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub is gone: the cache answers, the one GGUF needs no tag
    assert resolve_model("fake-org/real").gguf_file == "Q4_0/tiny-Q4_0.gguf"
    with pytest.raises(InvalidArgument,
                       match="no GGUF of the cached snapshot .*'Q8_0'.*Q4_0/tiny-Q4_0.gguf.*HF_HUB_OFFLINE"):
        load_model("fake-org/real:Q8_0")


def test_cli_generate_gguf_repo(hf_home):
    env = hub_env(hf_home)
    r = _cli(["generate", "--target", MULTI_REPO, "--target-file", "tiny-Q4_0.gguf", "--drafter", f"{G_REPO}@{G1}",
              "--prompt", "def add(a, b):", "--max-new-tokens", "6", "--json", "--target-dtype", "float32",
              "--drafter-dtype", "float32", "--cpu-linear", "plain"], env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert (out["target_revision"], out["drafter_revision"], len(out["token_ids"])) == (M1, G1, 6)
    assert "tiny-Q4_0.gguf (27.00 KiB) dequantised to float32: " in r.stderr, r.stderr
    r = _cli(["generate", "--target", MULTI_REPO, "--prompt", "x"], env)
    assert r.returncode == 2 and "model_file: " in r.stderr and "holds 4 GGUF files" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_model_file_flags_env_and_up(monkeypatch):
    import argparse

    from crossdraft.serving import modelserver
    from crossdraft.serving.up import UpConfig, child_commands

    def cfg(argv):
        p = argparse.ArgumentParser()
        modelserver.add_arguments(p, 50061)
        return modelserver.config_from_args(p.parse_args(argv))

    monkeypatch.delenv("CROSSDRAFT_MODEL_FILE", raising=False)
    assert cfg(["--model", "org/name"]).model_file is None
    assert cfg(["--model", "org/name", "--model-file", "m-Q4_0.gguf"]).model_file == "m-Q4_0.gguf"
    monkeypatch.setenv("CROSSDRAFT_MODEL_FILE", "sub/m.gguf")
    assert cfg(["--model", "org/name"]).model_file == "sub/m.gguf"
    cmds = child_commands(UpConfig(target="org/t", drafter="org/d:Q4_0", target_file="t-Q8_0.gguf",
                                   redis_url="redis://127.0.0.1:1/0", http_port=1001, grpc_port=1002,
                                   drafter_port=1003, verifier_port=1004))
    v, d = cmds["verifier"], cmds["drafter"]
    assert v[v.index("--model-file") + 1] == "t-Q8_0.gguf" and "--model-file" not in d
    assert d[d.index("--model") + 1] == "org/d:Q4_0"
