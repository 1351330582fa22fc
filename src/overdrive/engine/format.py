"""The engine file: a fixed preamble, a JSON header, then raw payload sections.

Layout (little endian)::

    b"ODENGINE"  8 bytes   magic
    u32                    format version (FORMAT_VERSION)
    u64                    header length H
    H bytes                header, UTF-8 JSON (backend, precision, build device, versions, bindings, sections,
                           signature)
    payload                sections back to back; the header holds each one's offset, length and sha256

Nothing in this module unpickles: the header is JSON and the sections are raw bytes that each backend hands
to its own runtime (an ONNX protobuf, a torch.export archive, Inductor's compile cache, an AOTInductor
library). Some of those runtimes execute what they load (engine/README.md, "What an engine is trusted with").
The sha256 values catch corruption; the ``signature`` (an HMAC-SHA256 over the header, which holds every
section's sha256, under the user's key: overdrive._utils.signing) tells an engine built by this user from one
that came from elsewhere or was edited, and :func:`authenticate` says which.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from overdrive._utils.errors import UsageError
from overdrive._utils.files import require_file
from overdrive._utils.signing import ALGORITHM, SigningKey, sign, signing_key, verify

MAGIC = b"ODENGINE"
FORMAT_VERSION = 1
_PRE = struct.Struct("<8sIQ")
MAX_HEADER_BYTES = 64 << 20  # a header is a few KB; a larger length field is corruption
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass
class EngineFile:
    """An engine file in memory: ``header`` (JSON-able dict) and named byte ``sections``."""

    header: dict[str, Any]
    sections: dict[str, bytes] = field(default_factory=dict)

    def to_bytes(self, key: SigningKey | None = None) -> bytes:
        """The file's bytes; signed with ``key`` when given (else unsigned)."""
        table, offset = {}, 0
        for name, blob in self.sections.items():
            table[name] = {"offset": offset, "length": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
            offset += len(blob)
        header = {k: v for k, v in self.header.items() if k not in ("signature", "header_sha256")}
        header.update(sections=table, payload_length=offset)
        if key is not None:
            header["signature"] = {"alg": ALGORITHM, "key_id": key.key_id, "mac": sign(_signed_bytes(header), key.key)}
        hbytes = json.dumps(header, sort_keys=True).encode()
        header["header_sha256"] = hashlib.sha256(hbytes).hexdigest()
        hbytes = json.dumps(header, sort_keys=True).encode()
        return _PRE.pack(MAGIC, FORMAT_VERSION, len(hbytes)) + hbytes + b"".join(self.sections.values())

    def save(self, path: str | Path, key: SigningKey | None = None) -> None:
        """Write the engine atomically, signed with ``key`` when given."""
        from overdrive._utils.files import atomic_write

        atomic_write(path, self.to_bytes(key))  # a reader of the path sees the old engine or the new one, never a part


def _signed_bytes(header: dict[str, Any]) -> bytes:
    """What the signature covers: the header without its signature and checksum, canonical JSON. The header
    holds each section's sha256 (verified on read), so this covers every payload byte too."""
    return json.dumps({k: v for k, v in header.items() if k not in ("signature", "header_sha256")},
                      sort_keys=True).encode()


def authenticate(header: dict[str, Any], key: SigningKey | None = None) -> tuple[str, str]:
    """Whether the engine with ``header`` was signed with the user's key: (status, why).

    status is ``"signed"`` (the signature verifies under this user's key), ``"unsigned"``, ``"foreign"``
    (signed with another key, or there is no key here) or ``"invalid"`` (the key id is this user's but the
    signature does not verify: the file was changed after signing).

    Example:
        >>> authenticate({"backend": "onnxruntime"})[0]
        'unsigned'
    """
    sig = header.get("signature")
    if sig is None:
        return "unsigned", "it is not signed (built by an overdrive before signing, or saved unsigned)"
    key = key if key is not None else signing_key(create=False)
    if key is None:
        return "foreign", "it is signed but there is no signing key here to check it with"
    if sig.get("key_id") != key.key_id:
        return "foreign", f"it is signed with another key (id {sig.get('key_id')}, this user's is {key.key_id})"
    if not verify(_signed_bytes(header), sig.get("mac"), key.key):
        return "invalid", "its signature does not verify: the file was changed after it was signed"
    return "signed", f"signed with this user's key ({key.source})"


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
    if hlen > MAX_HEADER_BYTES:
        raise UsageError(f"{source}: header length {hlen} bytes is more than the {MAX_HEADER_BYTES} an engine header "
                         "can be (corrupted file); rebuild the engine")
    if _PRE.size + hlen > len(data):
        raise UsageError(f"{source}: header of {hlen} bytes runs past the end of the {len(data)}-byte file "
                         "(truncated); rebuild the engine")
    raw = data[_PRE.size:_PRE.size + hlen]
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise UsageError(f"{source}: header is not valid JSON (corrupted file); rebuild the engine") from exc
    if not isinstance(header, dict):
        raise UsageError(f"{source}: header is a JSON {type(header).__name__}, not an object (corrupted file); "
                         "rebuild the engine")
    claimed = header.pop("header_sha256", None)
    if claimed != hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest():
        raise UsageError(f"{source}: header checksum mismatch (corrupted file); rebuild the engine")
    validate_header(header, source)
    return header, _PRE.size + hlen


_DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
_BACKENDS = ("inductor", "onnxruntime", "tensorrt")
_NEEDED = {"inductor": ("exported_program",), "onnxruntime": ("onnx",), "tensorrt": ()}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_header(h: dict[str, Any], source: str = "engine") -> None:
    """Check every header field that loading reads, with its type, before anything uses it.

    A header can pass its checksum and still hold wrong content (written by a buggy or a hostile tool); this
    turns each such case into one UsageError naming the field, instead of a KeyError or TypeError later.

    Example:
        >>> validate_header({"backend": "onnxruntime"})
        Traceback (most recent call last):
        ...
        overdrive._utils.errors.UsageError: engine: header field 'precision' is missing (expected a string); the file is corrupted or was not written by overdrive: rebuild the engine
    """
    def bad(field_: str, problem: str) -> UsageError:
        return UsageError(f"{source}: header field {field_!r} {problem}; the file is corrupted or was not written by "
                          "overdrive: rebuild the engine")

    def need(obj: dict[str, Any], name: str, types: tuple[type, ...] | type, what: str, where: str = "") -> Any:
        if name not in obj:
            raise bad(where + name, f"is missing (expected {what})")
        v = obj[name]
        if not isinstance(v, types) or isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
            raise bad(where + name, f"is {type(v).__name__} {str(v)[:40]!r} (expected {what})")
        return v

    if need(h, "backend", str, "a string") not in _BACKENDS:
        raise bad("backend", f"is {h['backend']!r}, not one of {', '.join(_BACKENDS)}")
    need(h, "precision", str, "a string")
    need(h, "torch", str, "a string")
    if h.get("cuda") is not None and not isinstance(h["cuda"], str):
        raise bad("cuda", "is not a string or null")
    dev = need(h, "device", dict, "an object")
    if need(dev, "type", str, "'cpu' or 'cuda'", "device.") not in ("cpu", "cuda"):
        raise bad("device.type", f"is {dev['type']!r}, not 'cpu' or 'cuda'")
    for k in (("name", "compute_capability") if dev["type"] == "cuda" else ("isa", "machine")):
        need(dev, k, str, "a string", "device.")
    if "backend_meta" in h and not isinstance(h["backend_meta"], dict):
        raise bad("backend_meta", "is not an object")
    inputs = need(h, "inputs", list, "a list of input bindings")
    if not inputs:
        raise bad("inputs", "is empty (an engine has at least one input)")
    for i, b in enumerate(inputs):
        where = f"inputs[{i}]."
        if not isinstance(b, dict):
            raise bad(f"inputs[{i}]", "is not an object")
        need(b, "name", str, "a string", where)
        if need(b, "dtype", str, "a dtype name", where) not in _DTYPES:
            raise bad(where + "dtype", f"is {b['dtype']!r}, not one of {', '.join(_DTYPES)}")
        if b.get("layout", "chw") not in ("chw", "hwc"):
            raise bad(where + "layout", f"is {b['layout']!r}, not 'chw' or 'hwc'")
        dims = [need(b, k, list, "a list of sizes", where) for k in ("min", "opt", "max")]
        if len({len(d) for d in dims}) != 1 or not all(_is_int(v) and 0 <= v < 1 << 40 for d in dims for v in d):
            raise bad(where + "min/opt/max", f"are not three equal-length lists of sizes: {str(dims)[:80]}")
        if not all(lo <= o <= hi for lo, o, hi in zip(*dims)):
            raise bad(where + "min/opt/max", f"do not hold min <= opt <= max: {dims}")
    for i, o in enumerate(need(h, "outputs", list, "a list of output bindings")):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise bad(f"outputs[{i}]", "is not an object with a string name")
    total = need(h, "payload_length", int, "a byte count")
    table = need(h, "sections", dict, "an object of sections")
    spans = []
    for name, sec in table.items():
        where = f"sections.{name}."
        if not isinstance(sec, dict):
            raise bad(f"sections.{name}", "is not an object")
        off, n = need(sec, "offset", int, "a byte offset", where), need(sec, "length", int, "a byte count", where)
        if not isinstance(sec.get("sha256"), str) or not _HEX64.fullmatch(sec["sha256"]):
            raise bad(where + "sha256", "is not 64 hex digits")
        if off < 0 or n < 0 or off + n > total:
            raise bad(f"sections.{name}", f"spans bytes {off}..{off + n}, outside the {total}-byte payload")
        spans.append((off, off + n, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise bad("sections", f"{a!r} and {b!r} overlap")
    missing = [n for n in _NEEDED[h["backend"]] if n not in table]
    if missing:
        raise bad("sections", f"lack {', '.join(map(repr, missing))}, which an engine of backend {h['backend']} needs")
    sig = h.get("signature")
    if sig is not None and not (isinstance(sig, dict) and all(isinstance(sig.get(k), str) for k in ("alg", "key_id", "mac"))
                                and sig["alg"] == ALGORITHM):
        raise bad("signature", f"is not a {ALGORITHM} signature record")


def model_file_kind(path: str | Path) -> str | None:
    """What a model file that is no engine holds, from its first bytes and (for a zip) its member names, nothing
    unpickled: ``onnx``, ``torchscript`` (torch.jit.save), ``exported`` (torch.export.save), ``torch.save`` (a
    state_dict or a pickled module), ``npy`` / ``npz`` (np.save / np.savez: arrays, no model), or None.

    Example:
        >>> import tempfile, torch
        >>> with tempfile.TemporaryDirectory() as d:
        ...     torch.jit.save(torch.jit.script(torch.nn.ReLU()), f"{d}/m.pt")
        ...     model_file_kind(f"{d}/m.pt")
        'torchscript'
    """
    import zipfile

    p = Path(path)
    try:
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK\x03\x04") and zipfile.is_zipfile(p):
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except (zipfile.BadZipFile, OSError):
            return None
        if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
            return "torchscript"
        if any(n.endswith("/archive_format") or "/models/" in n for n in names):
            return "exported"
        if any(n.endswith("/data.pkl") for n in names):
            return "torch.save"
        return "npz" if names and all(n.endswith(".npy") for n in names) else None
    # an ONNX ModelProto opens with field 1 (ir_version, a varint) and then one of its other fields' tags
    if p.suffix == ".onnx" or (len(head) > 2 and head[0] == 0x08):
        i = 1
        while i < len(head) and head[i] & 0x80:
            i += 1
        if p.suffix == ".onnx" or (i + 1 < len(head) and head[i + 1] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42)):
            return "onnx"
    return None


def _refuse_model_file(path: Path) -> None:
    """A model given where an engine goes (``--loadEngine model.onnx``, as trtexec's ``--onnx``): say which model
    file it is and the build line that makes an engine from it."""
    kind = model_file_kind(path)
    if kind not in ("onnx", "torchscript", "exported", "torch.save"):  # arrays or unknown: the wrong-magic error
        return
    out = f"{path.with_suffix('.engine').name}"
    how = {"onnx": f"overdrive build --onnx {path} --saveEngine {out}",
           "torchscript": f"overdrive build --torchscript {path} --shapes NAME:AxBx... --saveEngine {out}",
           "exported": f"overdrive build --exported {path} --saveEngine {out}",
           "torch.save": f"overdrive build --model file.py:factory --checkpoint {path} --shapes NAME:AxBx... "
                         f"--saveEngine {out}"}[kind]
    what = {"onnx": "an ONNX model", "torchscript": "a TorchScript module (torch.jit.save)",
            "exported": "a torch.export archive", "torch.save": "a torch.save file (weights or a pickled model)"}[kind]
    raise UsageError(f"{path} is {what}, not an overdrive engine; build an engine from it first: `{how}`, then load {out}")


def read(path: str | Path) -> EngineFile:
    """Read and verify an engine file: magic, version, header checksum, length and section checksums.

    Example:
        >>> # ef = read("model.engine"); ef.header["backend"]
    """
    p = require_file(path, "engine file", f"build one with `overdrive build --save-engine {path}`")
    with open(p, "rb") as f:  # the 8-byte magic first: a large file that is no engine is refused unread
        head = f.read(_PRE.size)
        if len(head) >= len(MAGIC) and head[:len(MAGIC)] != MAGIC:
            _refuse_model_file(p)
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
