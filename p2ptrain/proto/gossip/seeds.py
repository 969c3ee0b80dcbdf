"""Who chooses the coordinates an averaging exchange covers: neither side alone.

An exchange's seed chooses its subset. Chosen by the initiator, a member holding the key could
send every request with a seed whose subset holds the same few coordinates (one in ten seeds
covers any given run at a 10% subset): each of its requests then pulled those coordinates,
while the node's honest exchanges reached them one time in ten -- the clip and the share of
exchanges (spread.py, guard.py) bound each pull and how many there are, not where they land.
So the seed is drawn jointly, by commit and reveal, per ordered pair of nodes:

- with each request the initiator commits to a fresh secret nonce for its next exchange with
  that responder (`commit_of(nonce)`, 16 bytes of BLAKE2b: neither invertible nor open to
  a second nonce of the same commitment);
- the responder's answer to a request it applied grants a fresh random number for that next
  exchange, drawn after the commitment arrived;
- the next request reveals the nonce, and its seed must be `derive(nonce, grant, ...)`: the
  initiator fixed its nonce before it saw the grant, the responder the grant without knowing
  the nonce, so neither can steer the subset. (In a plan with a slow share the FAST_PAIR bit,
  which chooses the share covered, stays the initiator's -- and with it one of two subsets;
  without one, every bit must follow.)

The first exchange of a pair -- the responder holds nothing for that initiator (a first
contact, or either side restarted) -- takes the initiator's own random seed. A request whose
seed does not follow is declined and its initiator told to start over (`reseed`); a request
that reveals no nonce (zeros), or fails, starts a new chain (the responder takes its
commitment and grants anew) at most once every RESET_GAP seconds per initiator: an honest
pair whose reply was lost recovers in two exchanges, while a member cannot redraw seeds
faster than that. A declined request changes nothing, so it is retried with the same seed.
Parts after the first of an exchange carry its seed, each the one after the last taken: a
member may not skip to the part that holds its target.

Nonces and grants come from a per-process secret (the runtime's is from the OS; the node's
generator is seeded from public values) and a counter. Pure: no I/O, no clock (times are
passed in), no global random.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from p2ptrain.proto.gossip.plan import FAST_PAIR

NONCE_BYTES = 16
RESET_GAP = 10.0  # s between two new chains of one initiator at a responder, at least
MAX_PAIRS = 4096  # peers whose chain is remembered, each side (the oldest goes first)
MAX_SEED = 2**53  # exchange seeds stay exact in JSON
# what a request reveals when its pair's chain is not open: zeros of a nonce's length, so a
# request's size does not depend on the chain (the simulator's byte accounting is exact)
NO_NONCE = "00" * NONCE_BYTES


def commit_of(nonce: bytes) -> bytes:
    return hashlib.blake2b(nonce, digest_size=16, person=b"p2ptrain-commit").digest()


def derive(nonce: bytes, grant: int, initiator: str, responder: str) -> int:
    """The seed of an exchange from the initiator's revealed nonce and the responder's grant
    (node ids in hex), below MAX_SEED."""
    h = hashlib.blake2b(nonce + grant.to_bytes(8, "big") + bytes.fromhex(initiator)
                        + bytes.fromhex(responder), digest_size=8, person=b"p2ptrain-seed")
    return int.from_bytes(h.digest(), "big") % MAX_SEED


class _Draws:
    """Fresh values from a secret and a counter."""

    def __init__(self, secret: bytes):
        self.secret = secret
        self.count = 0

    def draw(self, n: int) -> bytes:
        self.count += 1
        return hashlib.blake2b(self.count.to_bytes(8, "big"), key=self.secret[:64],
                               digest_size=n, person=b"p2ptrain-draw").digest()


def _remember(table: OrderedDict, key: str, value: object) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_PAIRS:
        table.popitem(last=False)


class Seeds:
    """One node's side of every pair's seed chain: as initiator (`opening`, `answered`) and as
    responder (`check`, `taken`, `refused`)."""

    def __init__(self, me: str, secret: bytes, shares: bool = False):
        self.me = me
        self.shares = shares  # the plan covers a slow share unless FAST_PAIR: the bit is free
        self._draws = _Draws(secret)
        # initiator side: responder -> (the nonce committed to it, its grant or None)
        self.mine: OrderedDict[str, tuple[bytes, int | None]] = OrderedDict()
        # responder -> (seed of our last first part sent to it, the nonce that part committed)
        self.sent: OrderedDict[str, tuple[int, bytes]] = OrderedDict()
        # responder side: initiator -> (its commitment, our grant)
        self.theirs: OrderedDict[str, tuple[bytes, int]] = OrderedDict()
        self.parts: dict[str, tuple[int, int]] = {}  # initiator -> (seed, last part taken)
        self.resets: dict[str, float] = {}  # initiator -> when its last chain began

    # -- initiator ---------------------------------------------------------------------------

    def opening(self, peer: str, fresh: int, fast: bool | None = None) -> tuple[int, str, str]:
        """(seed, nonce revealed or NO_NONCE, commitment to the next nonce) of a new exchange
        with `peer`, in hex as a request carries them; `fresh` is the seed to take when the
        chain is not open; `fast` sets or clears the seed's FAST_PAIR bit (None: as drawn)."""
        nonce, grant = self.mine.get(peer, (b"", None))
        following = self._draws.draw(NONCE_BYTES)
        seed = fresh if grant is None else derive(nonce, grant, self.me, peer)
        if fast is not None:
            seed = seed | FAST_PAIR if fast else seed & ~FAST_PAIR
        _remember(self.sent, peer, (seed, following))
        return seed, nonce.hex() if grant is not None else NO_NONCE, commit_of(following).hex()

    def answered(self, peer: str, seed: int, grant: int, reseed: bool) -> None:
        """`peer`'s reply to a first part of exchange `seed` -- ours, on time or late: a grant
        opens the next link of the chain; `reseed` drops ours (the next request starts
        anew); neither leaves it as it was (declined: retried with the same seed)."""
        sent = self.sent.get(peer)
        if sent is None or sent[0] != seed:
            return  # not for our last exchange with it (the chain moved on since)
        if grant:
            _remember(self.mine, peer, (sent[1], grant))
        elif reseed:
            self.mine.pop(peer, None)

    # -- responder ---------------------------------------------------------------------------

    def check(self, peer: str, seed: int, part: int, reveal: bytes) -> bool:
        """Whether a request of `peer` for part `part` of exchange `seed` (revealing `reveal`)
        follows its chain."""
        if part > 0:
            taken = self.parts.get(peer)
            return taken is not None and taken[0] == seed and part == taken[1] + 1
        held = self.theirs.get(peer)
        if held is None:
            return True  # a first exchange: the initiator's own seed
        commitment, grant = held
        free = FAST_PAIR if self.shares else 0
        return (len(reveal) == NONCE_BYTES and commit_of(reveal) == commitment
                and derive(reveal, grant, peer, self.me) | free == seed | free)

    def taken(self, peer: str, seed: int, part: int, commitment: bytes) -> int:
        """A request that followed the chain was applied: the grant for its next exchange
        (0 for later parts: the chain moves with first parts)."""
        self.parts[peer] = (seed, part)
        if part > 0:
            return 0
        return self._grant(peer, commitment)

    def refused(self, peer: str, now: float, part: int, commitment: bytes) -> int:
        """A first part that did not follow the chain: the grant of a new chain from its
        commitment, or 0 if the initiator began one less than RESET_GAP ago (it is told to
        start over)."""
        if part > 0 or len(commitment) != 16 or now - self.resets.get(peer, -RESET_GAP) < (
                RESET_GAP):
            return 0
        self.resets[peer] = now
        if len(self.resets) > MAX_PAIRS:
            self.resets.pop(next(iter(self.resets)))
        return self._grant(peer, commitment)

    def _grant(self, peer: str, commitment: bytes) -> int:
        grant = 1 + int.from_bytes(self._draws.draw(8), "big") % (MAX_SEED - 1)
        _remember(self.theirs, peer, (commitment, grant))
        if len(self.parts) > MAX_PAIRS:
            self.parts.pop(next(iter(self.parts)))
        return grant
