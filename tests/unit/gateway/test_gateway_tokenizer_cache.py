"""The gateway's on-disk cache of the model servers' tokenizers ($CROSSDRAFT_HOME/tokenizers/<digest>)
when gateways on one host start together: each writes the files a server sent into a directory
of its own and renames it into place; one that finds a complete directory put there by another
keeps it (that gateway may be loading it) and loads it too. Replacing it removed it under the
other gateway's load, which then failed to start ("Repo id must be in the form ...")."""

from __future__ import annotations

from pathlib import Path

from gateway.server import _remote_tokenizer
from tests.tokenizers_fixtures import bytelevel_bpe_tokenizer

DIGEST = "0123456789abcdef" * 4


class _Server:
    """A model server's client as _remote_tokenizer uses it; ``on_fetch`` runs while the files are
    fetched (another gateway finishing its own copy in the meantime)."""

    who = "verifier"

    def __init__(self, files: dict[str, bytes], on_fetch=None):
        self.files, self.on_fetch = files, on_fetch

    def info(self) -> dict:
        return {"tokenizer_files_digest": DIGEST, "tokenizer_digest": "x"}

    def tokenizer_files(self):
        if self.on_fetch:
            self.on_fetch()
        return dict(self.files), DIGEST


def _files(tmp_path: Path) -> dict[str, bytes]:
    src = tmp_path / "src"
    bytelevel_bpe_tokenizer().save_pretrained(src)
    return {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}


def test_a_directory_another_gateway_completed_meanwhile_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    files = _files(tmp_path)
    cache = tmp_path / "home" / "tokenizers" / DIGEST[:32]

    theirs = []

    def other_gateway_done():  # its directory, renamed into place complete
        other = cache.with_name("other")
        other.mkdir(parents=True)
        for name, content in files.items():
            (other / name).write_bytes(content)
        (other / ".complete").write_text("ok")
        other.rename(cache)
        theirs.append(cache.stat().st_ino)

    tok = _remote_tokenizer(_Server(files, other_gateway_done))
    assert tok("def f(x):")["input_ids"]
    assert [cache.stat().st_ino] == theirs  # the other gateway's directory, not replaced under it
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]  # our copy removed

    # a later start finds it complete and fetches nothing
    assert _remote_tokenizer(_Server({}, lambda: (_ for _ in ()).throw(AssertionError("fetched"))))


def test_an_incomplete_directory_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDRAFT_HOME", str(tmp_path / "home"))
    cache = tmp_path / "home" / "tokenizers" / DIGEST[:32]
    cache.mkdir(parents=True)
    (cache / "tokenizer.json").write_text("{")  # a process died writing it (no .complete)
    tok = _remote_tokenizer(_Server(_files(tmp_path)))
    assert tok("def f(x):")["input_ids"]
    assert (cache / ".complete").exists()
