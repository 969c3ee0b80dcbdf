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
# The largest response the outbox reads to a request on each route: what the replies that
# route carries can weigh (acks, claims and refusals on control and track; a member list; an
# averaging part; a gradient's chunks for an outbound-only member). A key holder answering a
# ping with 72 MiB held that much per connection in flight to it -- ~1.1 GiB over the two
# pools' 12 -- before the MAC was checked; now ~0.35 GiB at most, most of it the bulk pool's
# four averaging and gradient bodies, which may honestly be that large.
REPLY_LIMIT: dict[str, int] = {
    "/v1/control": 1 * MiB,
    "/v1/members": wire.MAX_JSON + 64 * 1024,
    "/v1/gossip": MAX_REPLY,
    "/v1/average": MAX_REPLY,
    "/v1/track": 1 * MiB,
}


def route_of(body: m.Body) -> str:
    """The route a message body is posted to."""
    return _ROUTE_OF[type(body)]



async def read_limited(content, limit: int) -> bytearray | None:
    """The whole body, or None once it exceeds `limit` bytes (reading stops there). Held
    once: the pieces are appended as they come, not kept and joined (twice the body)."""
    body = bytearray()
    async for piece in content.iter_chunked(MiB):
        if len(body) + len(piece) > limit:
            return None
        body += piece
    return body
