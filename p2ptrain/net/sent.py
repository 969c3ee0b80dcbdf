"""What this node put on the wire, by message kind: `/v1/status` `sent_by_kind`.

Counted from the encoded frames themselves -- the exact bytes an HTTP request or response
body carries -- so it is the wire's figure, where the node's own `bytes_out` is the
protocol's (`wire.size` per message, whether or not the request got through). A kind is the
body's class name (`AverageRequest`, `GradientPush`, `Ping`...); per kind: `messages`,
`bytes` (whole frames: the 16-byte frame header, the JSON of header and body fields, the
binary tail) and `chunk_bytes` (the binary tail alone: the codec chunks of gradient and
averaging bodies, 0 for control messages). The outbox feeds it: a request's body each time a
peer answered the request carrying it, and every reply frame it encodes for a response.
Counting only: no I/O, no clock.
"""

from __future__ import annotations

from p2ptrain.proto import wire


class SentByKind:
    """Messages, body bytes and chunk bytes sent, per body class name."""

    def __init__(self) -> None:
        self._rows: dict[str, list[int]] = {}  # kind -> [messages, bytes, chunk bytes]

    def add(self, frame: bytes | bytearray | memoryview) -> None:
        """Count one encoded message frame as sent."""
        body = wire.peek_type(frame)
        row = self._rows.setdefault(body.__name__ if body else "unknown", [0, 0, 0])
        row[0] += 1
        row[1] += len(frame)
        row[2] += wire.peek_tail_size(frame)

    def document(self) -> dict[str, dict[str, int]]:
        """{kind: {"messages": n, "bytes": b, "chunk_bytes": c}}, kinds sorted."""
        return {kind: {"messages": n, "bytes": b, "chunk_bytes": c}
                for kind, (n, b, c) in sorted(self._rows.items())}
