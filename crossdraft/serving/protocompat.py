"""Backward-compatibility check of the wire contract (proto/crossdraft/v1/*.proto).

The protos are compiled with grpc_tools.protoc into a FileDescriptorSet and reduced to a
canonical, JSON-able summary (messages with their fields, services with their methods, enums
with their values, reserved numbers and names). :func:`check` compares an old summary with a
new one and lists the changes that break existing clients or servers; additions are fine.

    python -m crossdraft.serving.protocompat           # check against proto/compat/crossdraft.v1.json
    python -m crossdraft.serving.protocompat --write   # (re)write that snapshot
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PACKAGE_DIR = "crossdraft/v1"
SNAPSHOT = PROTO_ROOT / "compat" / "crossdraft.v1.json"
FORMAT = 1

_FDP = descriptor_pb2.FieldDescriptorProto


def compile_protos(proto_root: Path | str = PROTO_ROOT, package_dir: str = PACKAGE_DIR):
    """Compile ``proto_root/package_dir/*.proto`` into a FileDescriptorSet (imports included).

    Returns (descriptor set, the compiled files' names relative to ``proto_root``).
    """
    from grpc_tools import protoc

    root = Path(proto_root)
    files = sorted(p.relative_to(root).as_posix() for p in (root / package_dir).glob("*.proto"))
    if not files:
        raise FileNotFoundError(f"no .proto files under {root / package_dir}")
    well_known = str(resources.files("grpc_tools") / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "descriptors.pb"
        rc = protoc.main(
            [
                "protoc",
                f"-I{root}",
                f"-I{well_known}",
                "--include_imports",
                f"--descriptor_set_out={out}",
                *files,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed (exit {rc}) on {files} under {root}")
        fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return fds, files


def _type_name(field: descriptor_pb2.FieldDescriptorProto) -> str:
    return _FDP.Type.Name(field.type).removeprefix("TYPE_").lower()


def _label(field: descriptor_pb2.FieldDescriptorProto) -> str:
    return _FDP.Label.Name(field.label).removeprefix("LABEL_").lower()


def _message(msg: descriptor_pb2.DescriptorProto, full: str, out: dict[str, Any]) -> None:
    fields = {}
    for f in msg.field:
        oneof = None
        if f.HasField("oneof_index") and not f.proto3_optional:
            oneof = msg.oneof_decl[f.oneof_index].name
        fields[str(f.number)] = {
            "name": f.name,
            "type": _type_name(f),
            "type_name": f.type_name.lstrip("."),
            "label": _label(f),
            "oneof": oneof,
            "proto3_optional": bool(f.proto3_optional),
        }
    out["messages"][full] = {
        "fields": fields,
        # descriptor ranges are [start, end): stored inclusive
        "reserved_ranges": [[r.start, r.end - 1] for r in msg.reserved_range],
        "reserved_names": sorted(msg.reserved_name),
    }
    for nested in msg.nested_type:
        # map<K, V> entry types are included too: their key/value fields are part of the wire
        _message(nested, f"{full}.{nested.name}", out)
    for enum in msg.enum_type:
        _enum(enum, f"{full}.{enum.name}", out)


def _enum(enum: descriptor_pb2.EnumDescriptorProto, full: str, out: dict[str, Any]) -> None:
    out["enums"][full] = {
        "values": {v.name: v.number for v in enum.value},
        # enum reserved ranges are inclusive already
        "reserved_ranges": [[r.start, r.end] for r in enum.reserved_range],
        "reserved_names": sorted(enum.reserved_name),
    }


def summarize(fds: descriptor_pb2.FileDescriptorSet, files: list[str]) -> dict[str, Any]:
    """Canonical summary of the messages, enums and services defined in ``files``."""
    out: dict[str, Any] = {
        "format": FORMAT,
        "files": sorted(files),
        "messages": {},
        "enums": {},
        "services": {},
    }
    wanted = set(files)
    for fd in fds.file:
        if fd.name not in wanted:
            continue
        prefix = f"{fd.package}." if fd.package else ""
        for msg in fd.message_type:
            _message(msg, prefix + msg.name, out)
        for enum in fd.enum_type:
            _enum(enum, prefix + enum.name, out)
        for svc in fd.service:
            out["services"][prefix + svc.name] = {
                "methods": {
                    m.name: {
                        "input": m.input_type.lstrip("."),
                        "output": m.output_type.lstrip("."),
                        "client_streaming": bool(m.client_streaming),
                        "server_streaming": bool(m.server_streaming),
                    }
                    for m in svc.method
                }
            }
    # canonical order (json.dumps(sort_keys=True) sorts the rest)
    return json.loads(json.dumps(out, sort_keys=True))


def summarize_protos(proto_root: Path | str = PROTO_ROOT, package_dir: str = PACKAGE_DIR):
    """Compile and summarize the protos under ``proto_root``."""
    return summarize(*compile_protos(proto_root, package_dir))


def _in_ranges(number: int, ranges: list[list[int]]) -> bool:
    return any(lo <= number <= hi for lo, hi in ranges)


def _check_fields(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    problems = []
    new_fields = new["fields"]
    for number, of in sorted(old["fields"].items(), key=lambda kv: int(kv[0])):
        nf = new_fields.get(number)
        where = f"{name}: field {of['name']} = {number}"
        if nf is None:
            reserved = _in_ranges(int(number), new["reserved_ranges"]) and (
                of["name"] in new["reserved_names"]
            )
            if not reserved:
                renumbered = [n for n, f in new_fields.items() if f["name"] == of["name"]]
                how = f" (renumbered to {renumbered[0]})" if renumbered else ""
                problems.append(
                    f"{where} removed{how} without reserving both its number and its name"
                )
            continue
        if nf["name"] != of["name"]:
            problems.append(f"{where} renamed to {nf['name']} (number reused by another name)")
        if nf["type"] != of["type"] or nf["type_name"] != of["type_name"]:
            old_t = of["type_name"] or of["type"]
            new_t = nf["type_name"] or nf["type"]
            problems.append(f"{where} changed type {old_t} -> {new_t}")
        if nf["label"] != of["label"]:
            problems.append(f"{where} changed label {of['label']} -> {nf['label']}")
        if nf["oneof"] != of["oneof"]:
            problems.append(f"{where} moved from oneof {of['oneof']} to oneof {nf['oneof']}")
    for number, nf in new_fields.items():
        if number not in old["fields"] and (
            _in_ranges(int(number), old["reserved_ranges"]) or nf["name"] in old["reserved_names"]
        ):
            problems.append(f"{name}: new field {nf['name']} = {number} reuses a reserved number or name")
    return problems


def _check_enum(name: str, old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    problems = []
    new_values = new["values"]
    for value, number in sorted(old["values"].items(), key=lambda kv: kv[1]):
        if value not in new_values:
            reserved = _in_ranges(number, new["reserved_ranges"]) and value in new["reserved_names"]
            if not reserved:
                problems.append(f"{name}: enum value {value} = {number} removed")
        elif new_values[value] != number:
            problems.append(f"{name}: enum value {value} renumbered {number} -> {new_values[value]}")
    old_by_number = {n: v for v, n in old["values"].items()}
    for value, number in new_values.items():
        if value not in old["values"] and number in old_by_number and old_by_number[number] not in new_values:
            problems.append(f"{name}: enum number {number} reused by {value}")
    return problems


def check(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Breaking changes from summary ``old`` to summary ``new`` (empty = compatible)."""
    problems: list[str] = []
    for name, om in sorted(old["messages"].items()):
        nm = new["messages"].get(name)
        if nm is None:
            problems.append(f"message {name} removed")
        else:
            problems.extend(_check_fields(name, om, nm))
    for name, oe in sorted(old["enums"].items()):
        ne = new["enums"].get(name)
        if ne is None:
            problems.append(f"enum {name} removed")
        else:
            problems.extend(_check_enum(name, oe, ne))
    for name, osvc in sorted(old["services"].items()):
        nsvc = new["services"].get(name)
        if nsvc is None:
            problems.append(f"service {name} removed")
            continue
        for method, om in sorted(osvc["methods"].items()):
            nm = nsvc["methods"].get(method)
            where = f"{name}/{method}"
            if nm is None:
                problems.append(f"rpc {where} removed")
                continue
            for key in ("input", "output"):
                if nm[key] != om[key]:
                    problems.append(f"rpc {where} {key} type changed {om[key]} -> {nm[key]}")
            for key in ("client_streaming", "server_streaming"):
                if nm[key] != om[key]:
                    problems.append(f"rpc {where} {key} changed {om[key]} -> {nm[key]}")
    return problems


def load_snapshot(path: Path | str = SNAPSHOT) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def write_snapshot(summary: dict[str, Any], path: Path | str = SNAPSHOT) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m crossdraft.serving.protocompat",
        description="Check proto/crossdraft/v1 for backward-incompatible changes.",
    )
    parser.add_argument("--write", action="store_true", help="write the snapshot instead of checking")
    parser.add_argument("--proto-root", default=str(PROTO_ROOT), help="folder holding crossdraft/v1/")
    parser.add_argument("--snapshot", default=str(SNAPSHOT), help="snapshot JSON file")
    args = parser.parse_args(argv)
    current = summarize_protos(args.proto_root)
    if args.write:
        write_snapshot(current, args.snapshot)
        print(f"wrote {args.snapshot}")
        return 0
    problems = check(load_snapshot(args.snapshot), current)
    if problems:
        print(f"{len(problems)} breaking change(s) vs {args.snapshot}:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    print(f"compatible with {args.snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
