"""A node's life as its peers authenticate it, and the pair keys of two lives.

Every member holds the swarm key, so a MAC made with it says "a member sent this", not which
one: a member could sign requests under another's node id -- poison that member's replay
window with an incarnation of 10^18 so its real requests are refused for good, speak for it,
or answer a hello in its place. So the swarm key only admits; what a request says of its
sender is bound to the sender's own key:

- A *life* is a node's Ed25519 identity (identity.py: the node id is the hash of its public
  key), its incarnation, and an X25519 key made for this life alone. Its *card* is the X25519
  public key signed by the identity over (node id, incarnation), sent with every hello.
- Two lives that have seen each other's cards share a *pair key*: a keyed hash (by the swarm's
  MAC key the hello verified with) of their X25519 secret and both lives, salted by the node
  asked (`salted`: a new salt each time it has no pair of that life and key, so a request
  captured under a pair it forgot never verifies again). Requests and responses between them
  are MACed with it (auth.py). Another member has neither private key,
  so it cannot make or check that MAC; the swarm key is still needed, so an identity alone
  (no swarm key) gets nothing.

Pure: no I/O; the only randomness is the X25519 key a `Life` makes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from p2ptrain.identity import MAX_INCARNATION, Identity, node_id_of, verify_signature
from p2ptrain.proto import PROTOCOL_VERSION

_CARD_TAG = f"p2ptrain/{PROTOCOL_VERSION} card\n".encode()
_PAIR_PERSON = b"p2ptrain pair"  # BLAKE2b personalisation (<= 16 bytes)
_SALT_PERSON = b"p2ptrain salt"
SALT_BYTES = 16
_HEX = frozenset("0123456789abcdef")


class CardError(Exception):
    """A card is malformed, not signed by the node it names, or names another life."""


def _card_bytes(node_id: str, incarnation: int, exchange: bytes) -> bytes:
    return _CARD_TAG + f"{node_id}.{incarnation}.".encode() + exchange


def _unhex(text: str, size: int) -> bytes | None:
    return bytes.fromhex(text) if len(text) == 2 * size and set(text) <= _HEX else None


@dataclass(frozen=True, slots=True)
class Card:
    """One life's public half: who (node id, incarnation), its identity key, its X25519 key
    for this life, and the identity's signature over them."""

    node_id: str
    incarnation: int
    identity: bytes  # raw Ed25519 public key, 32 bytes
    exchange: bytes  # raw X25519 public key, 32 bytes
    signature: bytes  # 64 bytes

    def text(self) -> str:
        return (f"{self.incarnation}.{self.identity.hex()}.{self.exchange.hex()}."
                f"{self.signature.hex()}")

    @classmethod
    def parse(cls, text: object, node_id: str) -> Card:
        """The card `text` of node `node_id`; CardError unless it is well formed, its identity
        key hashes to `node_id` and its signature verifies."""
        if not isinstance(text, str) or len(text) > 400 or not text.isascii():
            raise CardError("malformed card")
        fields = text.split(".")
        if len(fields) != 4 or not fields[0].isdigit() or len(fields[0]) > 16:
            raise CardError("malformed card")
        incarnation = int(fields[0])
        identity, exchange = _unhex(fields[1], 32), _unhex(fields[2], 32)
        signature = _unhex(fields[3], 64)
        if identity is None or exchange is None or signature is None:
            raise CardError("malformed card")
        if not 0 <= incarnation < MAX_INCARNATION:
            raise CardError(f"card names incarnation {incarnation}, outside 0..2^52")
        if node_id_of(identity) != node_id:
            raise CardError(f"card's identity key is not node {node_id}'s")
        if not verify_signature(identity, signature, _card_bytes(node_id, incarnation,
                                                                 exchange)):
            raise CardError(f"card's signature does not verify (not node {node_id}'s)")
        return cls(node_id, incarnation, identity, exchange, signature)


class Life:
    """This node's life: its identity, incarnation and X25519 key (made here, never stored)."""

    def __init__(self, identity: Identity):
        self.node_id, self.incarnation = identity.node_id, identity.incarnation
        self._exchange = X25519PrivateKey.generate()
        public = self._exchange.public_key().public_bytes_raw()
        signature = identity.sign(_card_bytes(self.node_id, self.incarnation, public))
        self.card = Card(self.node_id, self.incarnation, identity.public_key, public, signature)

    @classmethod
    def throwaway(cls, incarnation: int = 1, key: Ed25519PrivateKey | None = None) -> Life:
        """A life under an identity held nowhere (`key`, default a new one): a token-only
        client (`checkpoint fetch`, the configuration fetch) or a test's peer."""
        private = key or Ed25519PrivateKey.generate()
        public = private.public_key().public_bytes_raw()
        return cls(Identity(private, public, node_id_of(public), incarnation))

    def pair_key(self, mac_key: bytes, peer: Card) -> bytes:
        """The key this life and `peer`'s share under the swarm MAC key `mac_key`; CardError
        for an X25519 key that gives no secret (a low-order point)."""
        try:
            shared = self._exchange.exchange(X25519PublicKey.from_public_bytes(peer.exchange))
        except ValueError:
            raise CardError("card's X25519 key gives no shared secret") from None
        lives = sorted([f"{self.node_id}.{self.incarnation}",
                        f"{peer.node_id}.{peer.incarnation}"])
        return hashlib.blake2b(shared + "|".join(lives).encode(), key=mac_key, digest_size=32,
                               person=_PAIR_PERSON).digest()


def salted(base: bytes, salt: bytes) -> bytes:
    """The pair key of `base` (Life.pair_key) under the node's `salt` (SALT_BYTES)."""
    return hashlib.blake2b(salt, key=base, digest_size=32, person=_SALT_PERSON).digest()
