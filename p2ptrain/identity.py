"""A node's identity: an Ed25519 key pair kept in its state directory.

The key is made on first start (file mode 0600); the node id is the first 16 bytes of the
SHA-256 of the raw public key, as 32 hex characters (safe in mDNS instance names). The
incarnation number is bumped at every start, so peers can tell a restarted node from a stale
message of its previous life.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from p2ptrain.fsutil import NotRegularFile, TooLarge, atomic_write_bytes, read_regular, write_small

KEY_FILE = "identity.key"
INCARNATION_FILE = "incarnation"
MAX_INCARNATION = 2**52  # what peers accept (proto/records.py MAX_EPOCH)


class IdentityError(Exception):
    """The state directory's identity cannot be used; the message says why."""


def node_id_of(public_key: bytes) -> str:
    return hashlib.sha256(public_key).digest()[:16].hex()


@dataclass(frozen=True)
class Identity:
    private_key: Ed25519PrivateKey
    public_key: bytes  # raw 32 bytes
    node_id: str  # 32 hex chars
    incarnation: int  # bumped at every start

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


def load_or_create(state_dir: Path, bump_incarnation: bool = True) -> Identity:
    """The identity of the node whose state lives in `state_dir` (created when absent)."""
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        msg = f"cannot create state directory {state_dir}: {exc.strerror or exc}"
        raise IdentityError(msg) from None
    key_path = state_dir / KEY_FILE
    if key_path.exists():
        try:  # a regular file of 32 bytes: a FIFO or device there is refused, not read
            raw = read_regular(key_path, 32)
        except TooLarge:
            raw = b""
        except NotRegularFile as exc:
            raise IdentityError(f"cannot read {key_path}: {exc}; move it away") from None
        except OSError as exc:  # e.g. a state dir made by `sudo p2ptrain join`, used without
            hint = (" (made by another user, e.g. root? fix its owner, or use another "
                    "--state-dir)" if isinstance(exc, PermissionError) else "")
            raise IdentityError(f"cannot read {key_path}: {exc.strerror or exc}{hint}") from None
        if len(raw) != 32:
            raise IdentityError(f"{key_path} is not a 32-byte Ed25519 private key; move it away")
        private = Ed25519PrivateKey.from_private_bytes(raw)
    else:
        private = Ed25519PrivateKey.generate()
        try:
            atomic_write_bytes(key_path, private.private_bytes_raw(), mode=0o600)
        except OSError as exc:
            msg = f"cannot create this node's identity in {state_dir}: {exc.strerror or exc}"
            raise IdentityError(msg) from None
    public = private.public_key().public_bytes_raw()
    inc_path = state_dir / INCARNATION_FILE
    incarnation = 0
    if inc_path.exists():
        # peers remember the incarnations they saw: removing only this file makes them refuse
        # the node as a replay; a new identity is a new member to them
        fresh = (f"remove it and {state_dir / KEY_FILE} to join as a new node (or write a "
                 f"number above the last one this node used)")
        try:  # (not a FIFO planted there: that hung the start)
            incarnation = int(read_regular(inc_path, 64).decode().strip() or 0)
        except (NotRegularFile, TooLarge) as exc:
            raise IdentityError(f"{inc_path} is {exc}; {fresh}") from None
        except (ValueError, UnicodeError):
            raise IdentityError(f"{inc_path} does not hold an integer; {fresh}") from None
        except OSError as exc:
            raise IdentityError(f"cannot read {inc_path}: {exc.strerror or exc}") from None
        if not 0 <= incarnation < MAX_INCARNATION:
            raise IdentityError(f"{inc_path} holds {incarnation}, outside 0..2^52 (damaged?); "
                                f"{fresh}")
    if bump_incarnation:
        incarnation += 1
        try:  # in place when the disk is full: a restart must never reuse an incarnation
            write_small(inc_path, f"{incarnation}\n".encode())
        except OSError as exc:
            msg = f"cannot record this start in {inc_path}: {exc.strerror or exc}"
            raise IdentityError(msg) from None
    return Identity(private, public, node_id_of(public), incarnation)
