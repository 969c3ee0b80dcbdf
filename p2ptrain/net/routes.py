"""The node's HTTP routes for protocol messages: which message bodies each route carries and
the largest body it accepts, shared by the server (what it accepts) and the outbox (where it
posts). Also the one bounded body reader both use. No state; no decisions.
"""

from __future__ import annotations

from p2ptrain.proto import (
    AverageReply,
    AverageRequest,
    GradientPush,
    GradientReply,
    TrackAck,
    TrackPush,
    wire,
)
from p2ptrain.proto import messages as m

MiB = 1 << 20
# route -> (body types it carries, largest body accepted)
ROUTES: dict[str, tuple[tuple[type, ...], int]] = {
    "/v1/control": ((m.Ping, m.Ack, m.PingReq, m.Notify, m.Refuse, m.Leave, m.Claim,
                     m.Heartbeat, m.Resign, m.Yield), 1 * MiB),
    "/v1/members": ((m.SyncRequest, m.SyncReply), wire.MAX_JSON + 64 * 1024),
    "/v1/gossip": ((GradientPush, GradientReply), 32 * MiB),
    "/v1/average": ((AverageRequest, AverageReply), wire.MAX_JSON + wire.MAX_BLOB),
    "/v1/track": ((TrackPush, TrackAck), wire.MAX_JSON + wire.MAX_BLOB),
}
_ROUTE_OF = {cls: route for route, (classes, _) in ROUTES.items() for cls in classes}
MAX_REPLY = wire.MAX_JSON + wire.MAX_BLOB + 64 * 1024  # a response body, at most


def route_of(body: m.Body) -> str:
    """The route a message body is posted to."""
    return _ROUTE_OF[type(body)]



async def read_limited(content, limit: int) -> bytes | None:
    """The whole body, or None once it exceeds `limit` bytes (reading stops there)."""
    parts, total = [], 0
    async for piece in content.iter_chunked(MiB):
        total += len(piece)
        if total > limit:
            return None
        parts.append(piece)
    return b"".join(parts)
