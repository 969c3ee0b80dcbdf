"""The MAC keys of one node while the swarm key is rotated: the current key, and the previous
one, accepted for a grace period.

`p2ptrain key rotate` makes a new swarm key and keeps the old one as the previous key
(`swarm.previous_key_file`, `swarm.previous_key_grace`). A node configured with both
- signs with the current key, except toward a peer that answered its hello only to the
  previous key (a member not restarted yet): that peer gets the previous key while the
  grace lasts (auth.Signer, hello.py);
- accepts requests and hellos MACed with either key while the grace lasts, and answers each
  with the key it came in with; after the grace it refuses the previous key, saying that the
  swarm key was rotated (auth.ServerAuth);
- advertises the current swarm id over mDNS and, during the grace, also takes peers that
  advertise the previous one (discovery.py).

The grace is counted in this node's own running time, on a monotonic clock, never by the
date: Pis have no real-time clock and an offline fleet has no time server. The time used is
reported through `on_used` (rotation.py saves it in the state directory) so that a restart
does not open the grace again. Pure bookkeeping: the clock and the hooks are passed in.
"""

from __future__ import annotations

from collections.abc import Callable

SAVE_EVERY = 10.0  # seconds of grace used between two `on_used` reports

ROTATED = ("the swarm key was rotated: this node signs with the swarm's previous key, whose "
           "grace period is over here; ask the swarm's operator for the new token")


class Keyring:
    """The current MAC key and, for `grace` seconds of this node's running time, the previous
    one (both already derived: auth.derive_mac_key)."""

    def __init__(self, current: bytes, previous: bytes | None = None, grace: float = 0.0, *,
                 clock: Callable[[], float] = lambda: 0.0, used: float = 0.0,
                 ids: tuple[str, str] = ("", ""),
                 on_used: Callable[[float], None] | None = None,
                 on_retired: Callable[[], None] | None = None):
        if previous == current:
            previous = None  # nothing to rotate from
        self.current, self.previous, self.grace = current, previous, grace
        self.current_id, self.previous_id = ids  # swarm ids (mDNS) of the two keys
        self._clock, self._start, self._used_before = clock, clock(), used
        self._on_used, self._on_retired = on_used, on_retired
        self._saved = used
        self.retired = previous is not None and used >= grace

    def used(self) -> float:
        """Seconds of grace used so far (earlier lives of the node included)."""
        return self._used_before + self._clock() - self._start

    def grace_left(self) -> float:
        """Seconds of running time the previous key is still accepted (0: none or over)."""
        if self.previous is None or self.retired:
            return 0.0
        return max(0.0, self.grace - self.used())

    def in_grace(self) -> bool:
        """Whether the previous key is accepted now; reports progress and the end once."""
        if self.previous is None or self.retired:
            return False
        used = self.used()
        if used >= self.grace:
            self.retired = True
            if self._on_used is not None:
                self._on_used(self.grace)
            if self._on_retired is not None:
                self._on_retired()
            return False
        if self._on_used is not None and used - self._saved >= SAVE_EVERY:
            self._saved = used
            self._on_used(used)
        return True

    def known(self) -> tuple[bytes, ...]:
        """Every key a MAC is checked against: the previous one too after its grace, so that
        its refusal can say why (`ROTATED`)."""
        return (self.current,) if self.previous is None else (self.current, self.previous)

    def accepted(self) -> tuple[bytes, ...]:
        """The keys accepted now, the current one first."""
        return (self.current, self.previous) if self.in_grace() else (self.current,)

    def accepts(self, key: bytes) -> bool:
        return key == self.current or (key == self.previous and self.in_grace())

    def accepts_swarm_id(self, swarm_id: str) -> bool:
        """Whether a peer advertising `swarm_id` (mDNS) may be of this swarm."""
        return swarm_id == self.current_id or (  # no hooks: mDNS may ask from its thread
            bool(self.previous_id) and swarm_id == self.previous_id and self.grace_left() > 0)


def keyring(keys: bytes | Keyring) -> Keyring:
    """`keys` as a Keyring (a bare MAC key: a swarm without rotation)."""
    return keys if isinstance(keys, Keyring) else Keyring(keys)
