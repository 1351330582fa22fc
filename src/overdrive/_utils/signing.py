"""The signing key that tells files this machine's user wrote from files that came from elsewhere.

Engines and timing caches hold sections that their runtimes may execute when loaded (a shared library, an
Inductor cache that unpickles). A plain checksum catches corruption but not tampering: whoever edits the file
recomputes it. So overdrive signs what it writes with an HMAC-SHA256 under a key the user controls, and loads
a file's executable parts only when the signature verifies under that key.

The key, first found wins:

1. ``OVERDRIVE_SIGNING_KEY``: the key itself (at least 16 characters), e.g. from a secrets manager; share it
   between the machines that should trust each other's engines;
2. ``OVERDRIVE_SIGNING_KEY_FILE``: a file holding it;
3. ``$XDG_CONFIG_HOME/overdrive/signing.key`` (``~/.config/overdrive/signing.key``): created with 32 random
   bytes, readable by the owner only, the first time something is signed.

Example:
    >>> key = b"0123456789abcdef0123456789abcdef"
    >>> mac = sign(b"payload", key)
    >>> verify(b"payload", mac, key), verify(b"payload!", mac, key)
    (True, False)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from overdrive._utils.errors import UsageError

ENV_KEY = "OVERDRIVE_SIGNING_KEY"
ENV_KEY_FILE = "OVERDRIVE_SIGNING_KEY_FILE"
ALGORITHM = "hmac-sha256"
_MIN_KEY = 16
log = logging.getLogger("overdrive")


@dataclass(frozen=True)
class SigningKey:
    """A key and where it came from (for messages); ``key_id`` names it without revealing it."""

    key: bytes
    source: str

    @property
    def key_id(self) -> str:
        return hashlib.sha256(b"overdrive-key-id\0" + self.key).hexdigest()[:16]


def default_key_file() -> Path:
    """``$XDG_CONFIG_HOME/overdrive/signing.key``, or ``~/.config/overdrive/signing.key``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "overdrive" / "signing.key"


def _read_key_file(path: Path, what: str) -> SigningKey:
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise UsageError(f"{what} {path}: cannot read the signing key ({exc.strerror or exc}); fix the path or its "
                         f"permissions, or unset {ENV_KEY_FILE}") from exc
    if len(key) < _MIN_KEY:
        raise UsageError(f"{what} {path}: the signing key is {len(key)} bytes, at least {_MIN_KEY} are needed; write "
                         "a longer one (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
    return SigningKey(key, str(path))


def signing_key(create: bool = False) -> SigningKey | None:
    """The user's signing key; ``create=True`` makes the default key file when no key is set anywhere.

    Returns None when there is no key and ``create`` is False (nothing can verify then).
    """
    env = os.environ.get(ENV_KEY)
    if env is not None:
        if len(env.strip()) < _MIN_KEY:
            raise UsageError(f"{ENV_KEY} is {len(env.strip())} characters, at least {_MIN_KEY} are needed; set a "
                             "longer key (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)")
        return SigningKey(env.strip().encode(), ENV_KEY)
    env_file = os.environ.get(ENV_KEY_FILE)
    if env_file:
        p = Path(env_file).expanduser()
        if not p.exists() and create:
            _create_key_file(p)
        return _read_key_file(p, ENV_KEY_FILE) if p.exists() else None
    p = default_key_file()
    if p.exists():
        return _read_key_file(p, "signing key file")
    if not create:
        return None
    _create_key_file(p)
    return _read_key_file(p, "signing key file")


def _create_key_file(path: Path) -> None:
    """Write a fresh key to a temporary file, then link it into place: a process racing to create the same
    key file either wins or reads the winner's whole key, never a half-written one."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise UsageError(f"cannot create the signing key file {path} ({exc.strerror or exc}); set {ENV_KEY} or "
                         f"{ENV_KEY_FILE} to a key you keep elsewhere") from exc
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
        log.info("created the signing key %s (engines and timing caches built here are signed with it)", path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def sign(payload: bytes, key: bytes) -> str:
    """HMAC-SHA256 of ``payload`` under ``key``, as hex."""
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def verify(payload: bytes, mac: str, key: bytes) -> bool:
    """Whether ``mac`` is ``payload``'s HMAC under ``key`` (constant-time compare)."""
    return isinstance(mac, str) and hmac.compare_digest(sign(payload, key), mac)
