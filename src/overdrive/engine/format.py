"""The engine file: a fixed preamble, a JSON header, then raw payload sections.

Layout (little endian)::

    b"ODENGINE"  8 bytes   magic
    u32                    format version (FORMAT_VERSION)
    u64                    header length H
    H bytes                header, UTF-8 JSON (backend, precision, build device, versions, bindings, sections)
    payload                sections back to back; the header holds each one's offset, length and sha256

Nothing in this module unpickles: the header is JSON and the sections are raw bytes that each backend hands
to its own runtime (an ONNX protobuf, a torch.export archive, Inductor's compile cache, an AOTInductor
library). Those runtimes may execute what they load (engine/README.md, "What an engine is trusted with"): the
checksums here catch corruption, not tampering.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overdrive._utils.errors import UsageError

MAGIC = b"ODENGINE"
FORMAT_VERSION = 1
_PRE = struct.Struct("<8sIQ")


@dataclass
class EngineFile:
    """An engine file in memory: ``header`` (JSON-able dict) and named byte ``sections``."""

    header: dict[str, Any]
    sections: dict[str, bytes] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        table, offset = {}, 0
        for name, blob in self.sections.items():
            table[name] = {"offset": offset, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
            offset += len(blob)
        header = dict(self.header, sections=table, payload_length=offset)
        hbytes = json.dumps(header, sort_keys=True).encode()
        header["header_sha256"] = hashlib.sha256(hbytes).hexdigest()
        hbytes = json.dumps(header, sort_keys=True).encode()
        return _PRE.pack(MAGIC, FORMAT_VERSION, len(hbytes)) + hbytes + b"".join(self.sections.values())

    def save(self, path: str | Path) -> None:
        from overdrive._utils.files import atomic_write

        atomic_write(path, self.to_bytes())  # a reader of the path sees the old engine or the new one, never a part


def read_header(data: bytes, source: str = "engine") -> tuple[dict[str, Any], int]:
    """Check the preamble and header of ``data``; return (header, payload offset)."""
    if len(data) < _PRE.size:
        raise UsageError(f"{source}: file is {len(data)} bytes, too short to be an overdrive engine "
                         "(truncated?); rebuild it with `overdrive build`")
    magic, version, hlen = _PRE.unpack_from(data)
    if magic != MAGIC:
        raise UsageError(f"{source}: wrong magic {magic!r} (expected {MAGIC!r}): not an overdrive engine file. "
                         "TensorRT .engine/.plan files load with trtexec; build an overdrive engine with `overdrive build`")
    if version < 1:
        raise UsageError(f"{source}: engine format version {version} does not exist (versions start at 1): the file "
                         "is corrupted or not written by overdrive; rebuild the engine")
    if version > FORMAT_VERSION:
        raise UsageError(f"{source}: engine format version {version} is newer than this overdrive reads "
                         f"(up to {FORMAT_VERSION}); upgrade overdrive or rebuild the engine")
    if _PRE.size + hlen > len(data):
        raise UsageError(f"{source}: header of {hlen} bytes runs past the end of the {len(data)}-byte file "
                         "(truncated); rebuild the engine")
    raw = data[_PRE.size:_PRE.size + hlen]
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{source}: header is not valid JSON (corrupted file); rebuild the engine") from exc
    claimed = header.pop("header_sha256", None)
    if claimed != hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest():
        raise UsageError(f"{source}: header checksum mismatch (corrupted file); rebuild the engine")
    return header, _PRE.size + hlen


def read(path: str | Path) -> EngineFile:
    """Read and verify an engine file: magic, version, header checksum, length and section checksums.

    Example:
        >>> # ef = read("model.engine"); ef.header["backend"]
    """
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"engine file {str(path)!r} does not exist; build one with `overdrive build --save-engine {path}`")
    with open(p, "rb") as f:  # the 8-byte magic first: a large file that is no engine is refused unread
        head = f.read(_PRE.size)
        if len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC:
            read_header(head.ljust(_PRE.size, b"\0"), str(path))  # raises the wrong-magic error
        data = head + f.read()
    header, start = read_header(data, str(path))
    expected = start + int(header.get("payload_length", 0))
    if len(data) != expected:
        what = "truncated" if len(data) < expected else "has trailing bytes"
        raise UsageError(f"{path}: file is {len(data)} bytes but its header says {expected} ({what}); rebuild the engine")
    sections = {}
    for name, s in header["sections"].items():
        blob = data[start + s["offset"]:start + s["offset"] + s["length"]]
        if hashlib.sha256(blob).hexdigest() != s["sha256"]:
            raise UsageError(f"{path}: checksum mismatch in section {name!r} (corrupted file); rebuild the engine")
        sections[name] = blob
    return EngineFile(header, sections)
