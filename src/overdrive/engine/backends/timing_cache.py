"""The ``--timing-cache`` file: Inductor's compile cache and the build's per-layer timings, signed with the user's key.

``torch.compiler.load_cache_artifacts`` unpickles, so a cache loads only when it carries this user's signature
(or the user says ``--trust-timing-cache``); it is written atomically, so concurrent builds cannot tear it.

Like TensorRT's timing cache, it also keeps what the int8/fp8 layer timing measured (``layer_choice``: each layer
shape's verdict and its kernel's tile config, keyed by the GPU, torch and overdrive versions and the layer's shape and
epilogue), so a rebuild reuses them instead of timing again. Layout of the signed payload: ``LAYERS_MAGIC``, the JSON
length (8 bytes, little-endian), the JSON, then Inductor's artifacts; a payload without ``LAYERS_MAGIC`` (written
before the timings were kept) is all artifacts.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from overdrive._utils.errors import UsageError
from overdrive._utils.files import atomic_write
from overdrive._utils.signing import sign, signing_key, verify

CACHE_MAGIC = b"ODTCACH1"  # + the HMAC of the payload under the user's signing key (64 hex digits) + the payload
LAYERS_MAGIC = b"ODTLAYR1"  # a payload that starts with the layer timings (JSON) before Inductor's artifacts


def _split(payload: bytes) -> tuple[dict[str, Any], bytes]:
    """(layer timings, Inductor artifacts) of a payload; ({}, payload) for one written before timings were kept."""
    if not payload.startswith(LAYERS_MAGIC):
        return {}, payload
    n = int.from_bytes(payload[len(LAYERS_MAGIC):len(LAYERS_MAGIC) + 8], "little")
    start = len(LAYERS_MAGIC) + 8
    try:
        layers = json.loads(payload[start:start + n].decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        layers = None
    if not isinstance(layers, dict):
        raise ValueError("its layer timings are not the JSON object this overdrive writes")
    return layers, payload[start + n:]


def load_timing_cache(path: str, trust: bool = False) -> dict[str, Any]:
    """Preload Inductor's compile cache from ``path`` (``--timing-cache``) if the file exists.

    The cache is handed to ``torch.compiler.load_cache_artifacts``, which unpickles, so it is loaded only
    when it carries this user's signature (written by :func:`save_timing_cache`) or ``trust`` is set; an
    unsigned or foreign file raises UsageError (before the build, the file left as it is). Returns what was done, for ``engine.info["timing_cache"]``. A signed file whose payload is not a
    cache written by ``torch.compiler.save_cache_artifacts`` raises UsageError naming it.

    Example:
        >>> # load_timing_cache("model.cache")  # {'path': 'model.cache', 'loaded': True, 'loaded_bytes': 51234, ...}
    """
    info: dict[str, Any] = {"path": str(path), "loaded": False, "loaded_bytes": 0, "loaded_artifacts": 0}
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--timing-cache {path}: folder {folder} does not exist; create it or give another path")
    if not os.path.exists(path):
        return info
    try:
        raw = open(path, "rb").read()
    except OSError as exc:
        raise UsageError(f"--timing-cache {path}: cannot read it ({exc}); give a readable file or a new path") from exc
    data, why = _verified_cache(raw)
    if why is not None and not trust:  # refused before the build, and the file is left as it is
        raise UsageError(f"--timing-cache {path}: {why}, and a cache unpickles when loaded, so only caches signed "
                         "with your key load; delete the file (the next build writes a signed one), give another "
                         "path, or pass --trust-timing-cache if you know where it came from")
    if why is not None:  # trusted: the whole file, or the payload after a foreign signature
        data = raw[len(CACHE_MAGIC) + 64:] if raw.startswith(CACHE_MAGIC) else raw
    try:
        layers, data = _split(data)
    except ValueError as exc:
        raise UsageError(f"--timing-cache {path}: {exc}; delete it or give a new path, and the next build writes a "
                         "fresh one") from exc
    cache_info = torch.compiler.load_cache_artifacts(data) if data else None
    if cache_info is None:  # torch returns None (and logs) when the bytes do not deserialize
        raise UsageError(f"--timing-cache {path}: the file is empty or not an Inductor compile cache "
                         f"(torch.compiler.save_cache_artifacts bytes from torch {torch.__version__}); delete it "
                         "or give a new path, and the next build writes a fresh one")
    info.update(loaded=True, loaded_bytes=len(raw),
                loaded_artifacts=sum(len(v) for v in getattr(cache_info, "artifacts", {}).values()),
                loaded_layer_timings=len(layers))
    info["layer_timings"] = layers  # the build takes them out (layer_choice reads and extends them) before saving
    return info


def _verified_cache(raw: bytes) -> tuple[bytes, str | None]:
    """(payload, None) when ``raw`` is a cache signed with this user's key, else (b"", why not)."""
    if not raw.startswith(CACHE_MAGIC):
        return b"", "it is not signed (written by an older overdrive or another tool)"
    mac, payload = raw[len(CACHE_MAGIC):len(CACHE_MAGIC) + 64].decode("ascii", "replace"), raw[len(CACHE_MAGIC) + 64:]
    key = signing_key(create=False)
    if key is None:
        return b"", "it is signed but there is no signing key here to check it with"
    if not verify(payload, mac, key.key):
        return b"", "its signature does not verify under your key (signed elsewhere, or changed)"
    return payload, None


def save_timing_cache(path: str, artifacts: bytes | None, info: dict[str, Any],
                      layer_timings: dict[str, Any] | None = None) -> None:
    """Write the compile cache and the layer timings to ``path``, signed with the user's key, atomically (temp file +
    rename); keeps the old file if there is nothing new."""
    if not artifacts:
        info["saved_bytes"] = 0
        return
    payload = artifacts
    if layer_timings:
        text = json.dumps(layer_timings, sort_keys=True).encode("utf-8")
        payload = LAYERS_MAGIC + len(text).to_bytes(8, "little") + text + artifacts
        info["saved_layer_timings"] = len(layer_timings)
    key = signing_key(create=True)
    try:
        blob = CACHE_MAGIC + sign(payload, key.key).encode("ascii") + payload
        atomic_write(path, blob)
    except OSError as exc:
        raise UsageError(f"--timing-cache {path}: cannot write it ({exc}); give a path in a writable folder") from exc
    info["saved_bytes"] = len(blob)
