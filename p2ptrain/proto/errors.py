"""The two kinds of error of the control plane, as in h11: the peer misbehaved, or you did.

`RemoteProtocolError` means bytes or a message from a peer are malformed or illegal (a
truncated frame, an unknown version, a wrong type, a forged claim from a non-member). The
decoder raises it; `Control.handle` turns it into a `RemoteError` action and leaves every bit
of state as it was, so the driver can answer 4xx with `reason` and carry on.

`LocalProtocolError` means the caller used the API wrongly (time running backwards, an unknown
event type, a sample count that shrinks). It is a bug in the driver, never caused by a peer.
This file owns the two classes and nothing else.
"""

from __future__ import annotations


class RemoteProtocolError(ValueError):
    """A peer sent something malformed or illegal; refuse it. `reason` is one short sentence."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class LocalProtocolError(RuntimeError):
    """The caller misused the control-plane API; state is unchanged."""
