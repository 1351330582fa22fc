"""What loading an engine trusts (issue 18, cases 1, 2, 13): signed engines load whole, anything else loads in
safe mode, in which nothing from the file runs; headers are checked against a schema; byte flips anywhere in an
engine give a clear error or the same outputs, never different ones.

The attacks are rebuilt as the issue describes them: a marker-writing pickle in the exported program's weights,
a shared library whose constructor writes a marker in place of the AOTInductor library, a compile cache handed
to Inductor, an edited header with its checksums recomputed."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import shutil
import struct
import subprocess
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.signing import SigningKey
from overdrive.engine import Builder, BuildConfig, Engine, ShapeProfile
from overdrive.engine import format as fmt
from overdrive.engine.backends import timing_cache
from overdrive.engine.backends.inductor import aoti_works
from overdrive.engine.sources import load_exported


class _Marker:
    """Unpickling this creates ``path``: the proof that a pickle ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3)).eval()


X = torch.randn(2, 6, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A signed Inductor engine holding the exported program and a compile cache (the torch.compile path)."""
    path = tmp_path_factory.mktemp("trust") / "c.engine"
    Builder(BuildConfig(backend="inductor", aot=False)).build(_model(), X).save(path)
    return path


@pytest.fixture(scope="module")
def ort_engine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trust") / "o.engine"
    Builder(BuildConfig(backend="onnxruntime", profiles=(ShapeProfile("input", (1, 6), (2, 6), (4, 6)),))).build(
        _model(), X).save(path)
    return path


def _unsigned_copy(src: Path, dst: Path, **sections: bytes) -> Path:
    """What an attacker can write: any content, with every sha256 recomputed, but no signature."""
    ef = fmt.read(src)
    ef.sections.update(sections)
    ef.save(dst)  # no key: unsigned
    return dst


def test_signed_engine_loads_whole(compiled: Path) -> None:
    eng = Engine.load(compiled)
    assert eng.info["trust"]["signature"] == "signed" and eng.info["trust"]["mode"] == "full"
    assert eng.info["runtime"] == "torch.compile (from cache)"
    torch.testing.assert_close(eng(X), _model()(X), rtol=1e-5, atol=1e-5)


def test_unsigned_compile_cache_is_not_loaded(compiled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch.compiler.load_cache_artifacts
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(len(data)) or real(data))
    bad = _unsigned_copy(compiled, tmp_path / "u.engine")
    with pytest.warns(UserWarning, match="safe mode"):
        eng = Engine.load(bad)
    assert calls == [] and eng.info["trust"] == {"signature": "unsigned", "why": eng.info["trust"]["why"],
                                                 "trusted": False, "mode": "safe"}
    torch.testing.assert_close(eng(X), _model()(X), rtol=1e-5, atol=1e-5)  # safe mode: the same outputs
    Engine.load(bad, trust=True)  # --trust: the user's explicit choice loads the cache
    assert len(calls) == 1


def test_pickled_weights_in_exported_program_never_run(compiled: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    ep_bytes = fmt.read(compiled).sections["exported_program"]
    zin, out = zipfile.ZipFile(io.BytesIO(ep_bytes)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            data = zin.read(name)
            if name.endswith("model_weights_config.json"):
                cfg = json.loads(data)
                first = next(iter(cfg["config"]))
                cfg["config"][first]["use_pickle"] = True  # torch.export.load then calls torch.load(weights_only=False)
                victim = cfg["config"][first]["path_name"]
                data = json.dumps(cfg).encode()
            zout.writestr(name, data)
    crafted = out.getvalue()
    zin2, out2 = zipfile.ZipFile(io.BytesIO(crafted)), io.BytesIO()
    with zipfile.ZipFile(out2, "w", zipfile.ZIP_STORED) as zout:
        for name in zin2.namelist():
            zout.writestr(name, pickle.dumps(_Marker(marker)) if name.endswith("weights/" + victim) else zin2.read(name))
    bad = _unsigned_copy(compiled, tmp_path / "p.engine", exported_program=out2.getvalue())
    for trust in (False, True):  # the exported program is read weights-only even when the user trusts the file
        with pytest.raises(UsageError, match="pickled objects other than tensors"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Engine.load(bad, trust=trust)
        assert not marker.exists()
    with pytest.raises(UsageError, match="pickled objects"):
        load_exported(out2.getvalue(), "x.pt2")
    assert not marker.exists()


@pytest.mark.skipif(not aoti_works() or shutil.which("cc") is None,
                    reason="needs a torch whose AOTInductor loads (>= 2.12) and a C compiler")
def test_foreign_native_library_never_loads(tmp_path: Path) -> None:
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    so = tmp_path / "evil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    eng_path = tmp_path / "a.engine"
    Builder(BuildConfig(backend="inductor")).build(_model(), X).save(eng_path)  # CPU default: the AOTI package
    ef = fmt.read(eng_path)
    assert "aoti_package" in ef.sections
    zin, out = zipfile.ZipFile(io.BytesIO(ef.sections["aoti_package"])), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
        for name in zin.namelist():
            zout.writestr(name, so.read_bytes() if name.endswith(".so") else zin.read(name))
    bad = _unsigned_copy(eng_path, tmp_path / "evil.engine", aoti_package=out.getvalue())
    with pytest.warns(UserWarning, match="safe mode"):
        eng = Engine.load(bad)
    assert not marker.exists() and eng.info["runtime"] == "torch.compile"
    torch.testing.assert_close(eng(X), _model()(X), rtol=1e-5, atol=1e-5)
    # the same file, signed by someone else's key: still foreign, still safe
    fmt.EngineFile(fmt.read(bad).header, fmt.read(bad).sections).save(tmp_path / "other.engine",
                                                                       SigningKey(b"k" * 32, "other"))
    with pytest.warns(UserWarning, match="another key"):
        Engine.load(tmp_path / "other.engine")
    assert not marker.exists()


def test_edited_signed_header_is_invalid(compiled: Path, tmp_path: Path) -> None:
    data = compiled.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data)
    header = json.loads(data[20:20 + hlen])
    header.pop("header_sha256")
    header["backend_meta"]["compile_mode"] = "max-autotune"  # keeps the signature, recomputes the checksum
    hb = json.dumps(header, sort_keys=True).encode()
    header["header_sha256"] = __import__("hashlib").sha256(hb).hexdigest()
    hb = json.dumps(header, sort_keys=True).encode()
    (tmp_path / "e.engine").write_bytes(struct.pack("<8sIQ", b"ODENGINE", 1, len(hb)) + hb + data[20 + hlen:])
    assert fmt.authenticate(fmt.read(tmp_path / "e.engine").header)[0] == "invalid"
    with pytest.warns(UserWarning, match="changed after it was signed"):
        assert Engine.load(tmp_path / "e.engine").info["trust"]["mode"] == "safe"


def test_saving_an_untrusted_engine_does_not_sign_it(compiled: Path, tmp_path: Path) -> None:
    bad = _unsigned_copy(compiled, tmp_path / "u.engine")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Engine.load(bad)
    with pytest.warns(UserWarning, match="unsigned"):
        eng.save(tmp_path / "again.engine")
    assert fmt.authenticate(fmt.read(tmp_path / "again.engine").header)[0] == "unsigned"


def test_timing_cache_is_signed_and_foreign_ones_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "t.cache"
    info: dict = {}
    timing_cache.save_timing_cache(str(cache), b"not a real cache", info)
    assert cache.read_bytes().startswith(timing_cache.CACHE_MAGIC)
    calls: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: calls.append(data) or None)
    with pytest.raises(UsageError, match="not an Inductor compile cache"):  # signed: handed to Inductor, which says no
        timing_cache.load_timing_cache(str(cache))
    assert calls == [b"not a real cache"]
    cache.write_bytes(pickle.dumps(_Marker(tmp_path / "ran")))  # an unsigned file in its place
    with pytest.raises(UsageError, match="not signed.*--trust-timing-cache"):
        timing_cache.load_timing_cache(str(cache))
    assert len(calls) == 1 and cache.read_bytes() == pickle.dumps(_Marker(tmp_path / "ran"))  # left as it was
    cache.write_bytes(timing_cache.CACHE_MAGIC + b"0" * 64 + b"payload")
    with pytest.raises(UsageError, match="does not verify"):
        timing_cache.load_timing_cache(str(cache))
    assert len(calls) == 1 and not (tmp_path / "ran").exists()
    with pytest.raises(UsageError, match="not an Inductor compile cache"):
        timing_cache.load_timing_cache(str(cache), trust=True)  # the user's explicit choice: handed to Inductor
    assert calls[-1] == b"payload"


def test_other_cpu_recompiles_instead_of_running_its_native_code(compiled: Path, tmp_path: Path) -> None:
    ef = fmt.read(compiled)
    ef.header["device"] = dict(ef.header["device"], isa="SOME_OTHER_ISA")
    ef.save(tmp_path / "isa.engine", __import__("overdrive._utils.signing", fromlist=["x"]).signing_key(create=True))
    with pytest.warns(UserWarning, match="compiled again for this CPU"):
        eng = Engine.load(tmp_path / "isa.engine")
    assert eng.info["trust"]["mode"] == "recompiled" and eng.info["runtime"] == "torch.compile"


@pytest.mark.parametrize("edit, field", [
    (lambda h: h.pop("inputs"), "'inputs' is missing"),
    (lambda h: h.update(inputs="x"), "'inputs' is str"),
    (lambda h: h["inputs"][0].update(min=[9, 6]), "min <= opt <= max"),
    (lambda h: h["inputs"][0].update(dtype="complex128"), "inputs\\[0\\].dtype"),
    (lambda h: h.update(backend="evil"), "'backend' is 'evil'"),
    (lambda h: h["device"].pop("isa"), "'device.isa' is missing"),
    (lambda h: h.update(device=[1]), "'device' is list"),
    (lambda h: h["sections"]["onnx"].update(offset=-5), "outside the"),
    (lambda h: h["sections"]["onnx"].update(sha256=7), "64 hex digits"),
    (lambda h: h.update(sections={}), "lack 'onnx'"),
    (lambda h: h.update(payload_length="10"), "'payload_length' is str"),
    (lambda h: h.update(signature="yes"), "signature record"),
])
def test_header_schema(ort_engine: Path, tmp_path: Path, edit, field: str) -> None:
    data = ort_engine.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data)
    h = json.loads(data[20:20 + hlen])
    h.pop("header_sha256")
    edit(h)
    hb = json.dumps(h, sort_keys=True).encode()
    h["header_sha256"] = __import__("hashlib").sha256(hb).hexdigest()
    hb = json.dumps(h, sort_keys=True).encode()
    path = tmp_path / "s.engine"
    path.write_bytes(struct.pack("<8sIQ", b"ODENGINE", 1, len(hb)) + hb + data[20 + hlen:])
    with pytest.raises(UsageError, match=field):
        Engine.load(path)


def test_deeply_nested_header_and_huge_length(tmp_path: Path) -> None:
    deep = b"[" * 200_000
    (tmp_path / "d.engine").write_bytes(struct.pack("<8sIQ", b"ODENGINE", 1, len(deep)) + deep)
    with pytest.raises(UsageError, match="not valid JSON"):
        Engine.load(tmp_path / "d.engine")
    (tmp_path / "h.engine").write_bytes(struct.pack("<8sIQ", b"ODENGINE", 1, 1 << 60) + b"{}")
    with pytest.raises(UsageError, match="header length"):
        Engine.load(tmp_path / "h.engine")


def test_byte_flips_give_an_error_or_the_same_outputs(ort_engine: Path, tmp_path: Path) -> None:
    """Fuzz: 150 seeded single-byte flips over the whole file, denser in the preamble and header."""
    data = ort_engine.read_bytes()
    _, _, hlen = struct.unpack_from("<8sIQ", data)
    want = Engine.load(ort_engine)(X)
    rng = random.Random(0)
    positions = rng.sample(range(20 + hlen), 100) + rng.sample(range(20 + hlen, len(data)), 50)
    outcomes = {"error": 0, "same": 0}
    for pos in positions:
        flipped = bytearray(data)
        flipped[pos] ^= 1 << rng.randrange(8)
        path = tmp_path / "f.engine"
        path.write_bytes(bytes(flipped))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = Engine.load(path)(X)
        except UsageError:
            outcomes["error"] += 1
            continue
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # loaded: must be the same engine
        outcomes["same"] += 1
    assert outcomes["error"] >= 140, outcomes  # every flip breaks a checksum or the preamble


def test_bad_signing_key_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from overdrive._utils.signing import signing_key

    monkeypatch.setenv("OVERDRIVE_SIGNING_KEY", "short")
    with pytest.raises(UsageError, match="at least 16"):
        signing_key()
    monkeypatch.delenv("OVERDRIVE_SIGNING_KEY")
    monkeypatch.setenv("OVERDRIVE_SIGNING_KEY_FILE", str(tmp_path / "new" / "k"))
    key = signing_key(create=True)
    assert key is not None and (tmp_path / "new" / "k").stat().st_mode & 0o777 == 0o600
    assert signing_key().key == key.key and os.environ["OVERDRIVE_SIGNING_KEY_FILE"].endswith("k")
