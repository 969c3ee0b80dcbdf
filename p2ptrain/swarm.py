"""A swarm: a name and a 256-bit key. The join token, the swarm id that mDNS advertises, the
demo swarm, and the files `p2ptrain init` writes.

A join token is one copy-pasteable string, `p2pt1.<name>.<key as unpadded base64url>`; it
holds the key, so it is a secret (like `docker swarm join-token`). The swarm id is a hash of
the key: it tells two swarms on one LAN apart without revealing the key. The demo swarm's key
is public (a hash of a fixed phrase): anyone may join it, which `join` says when it starts.

Key rotation (`p2ptrain key rotate`, `rotate_key_files`): a new key replaces the old one in
the key file, and the old one is kept in the previous-key file, which a node accepts for a
grace period (p2ptrain.net.keyring). A `Swarm` carries that previous key, if any.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path

from p2ptrain.fsutil import atomic_write_bytes

TOKEN_PREFIX = "p2pt1"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
DEMO_NAME = "demo"
MAX_KEY_FILE_BYTES = 4096  # a key file is 32 bytes or a one-line token
KEY_FILE, CONFIG_FILE = "swarm.key", "swarm.toml"
PREVIOUS_TAG = ".previous"  # swarm.key -> swarm.previous.key


class SwarmError(Exception):
    """A token, key file or swarm name is unusable; the message says why."""


@dataclass(frozen=True)
class Swarm:
    name: str
    key: bytes  # 32 bytes, secret
    # during a key rotation: the swarm's previous key, accepted for a grace period (secret)
    previous: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def swarm_id(self) -> str:
        """16 hex characters derived from the key: safe to advertise."""
        return swarm_id_of(self.key)

    @property
    def previous_id(self) -> str:
        """The swarm id of the previous key ("" without one)."""
        return swarm_id_of(self.previous) if self.previous is not None else ""

    def with_previous(self, previous: Swarm) -> Swarm:
        """This swarm, also holding `previous`'s key as its previous key."""
        if previous.key == self.key:
            raise SwarmError("the previous swarm key is the current one: nothing was rotated")
        return replace(self, previous=previous.key)

    @property
    def is_demo(self) -> bool:
        return self.key == demo_swarm().key

    def token(self) -> str:
        key = base64.urlsafe_b64encode(self.key).rstrip(b"=").decode()
        return f"{TOKEN_PREFIX}.{self.name}.{key}"

    def __repr__(self) -> str:  # never print the key by accident
        return f"Swarm(name={self.name!r}, swarm_id={self.swarm_id!r})"


def swarm_id_of(key: bytes) -> str:
    return hashlib.sha256(b"p2ptrain swarm id\n" + key).hexdigest()[:16]


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise SwarmError(f"swarm name {name!r}: use 1-32 letters, digits, '-' or '_'")
    return name


def new_swarm(name: str) -> Swarm:
    return Swarm(check_name(name), secrets.token_bytes(32))


def demo_swarm() -> Swarm:
    """The public demo swarm: its key is the hash of a phrase printed in this file."""
    return Swarm(DEMO_NAME, hashlib.sha256(b"p2ptrain public demo swarm, anyone may join").digest())


def parse_token(token: str) -> Swarm:
    """The swarm a join token names; SwarmError saying what is wrong otherwise."""
    parts = token.strip().split(".")
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise SwarmError(f"not a p2ptrain join token (expected {TOKEN_PREFIX}.NAME.KEY; "
                         f"`p2ptrain init` prints one)")
    name, key_text = check_name(parts[1]), parts[2]
    try:
        key = base64.b64decode(key_text + "=" * (-len(key_text) % 4), altchars=b"-_",
                               validate=True)
    except (binascii.Error, ValueError):
        raise SwarmError("join token: the key part is not base64url") from None
    if len(key) != 32:
        raise SwarmError(f"join token: the key is {len(key)} bytes, expected 32")
    return Swarm(name, key)


def read_key_file(path: Path, name: str) -> Swarm:
    """A swarm from a key file written by `init` (32 raw bytes, or a token on one line)."""
    try:  # (a pipe is read: `--key-file <(pass show swarm)`; /dev/zero cannot fill memory)
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise SwarmError(f"swarm key file {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_KEY_FILE_BYTES:
        raise SwarmError(f"swarm key file {path}: larger than {MAX_KEY_FILE_BYTES} bytes")
    if raw.strip().startswith(TOKEN_PREFIX.encode()):
        return parse_token(raw.decode("ascii", "replace"))
    if len(raw) != 32:
        raise SwarmError(f"swarm key file {path} holds {len(raw)} bytes, expected 32")
    return Swarm(check_name(name), raw)


def write_init_files(swarm: Swarm, out: Path, config_toml: str) -> tuple[Path, Path]:
    """Write the key (mode 0600) and the swarm's configuration into `out`; refuse to
    overwrite an existing key (that would orphan the swarm's members)."""
    out.mkdir(parents=True, exist_ok=True)
    key_path, config_path = out / KEY_FILE, out / CONFIG_FILE
    if key_path.exists():
        raise SwarmError(f"{key_path} exists: this directory already holds a swarm; "
                         f"choose another --out")
    atomic_write_bytes(key_path, swarm.key, mode=0o600)
    atomic_write_bytes(config_path, config_toml.encode())
    return key_path, config_path


def previous_path(key_path: Path) -> Path:
    """Where `rotate_key_files` keeps the previous key: swarm.key -> swarm.previous.key."""
    return key_path.with_name(key_path.stem + PREVIOUS_TAG + key_path.suffix)


def keep_previous(key_path: Path, previous: Path, name: str) -> Swarm:
    """The first half of a rotation: copy the key in `key_path` to `previous` (mode 0600,
    atomically); the swarm it holds."""
    old = read_key_file(key_path, name)
    atomic_write_bytes(previous, old.key, mode=0o600)
    return old


def replace_key(key_path: Path, old: Swarm) -> Swarm:
    """The second half: a new key for `old`'s swarm in `key_path` (mode 0600, atomically, so
    there is no moment without a key file)."""
    new = Swarm(old.name, secrets.token_bytes(32))
    atomic_write_bytes(key_path, new.key, mode=0o600)
    return new
