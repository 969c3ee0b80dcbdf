"""Message authentication on the MAC routes: HMAC-SHA256 keyed by the swarm key, and replay
refusal by per-sender (incarnation, sequence).

A request carries three headers:

    X-P2P-Sender  the sender's node id (32 hex)
    X-P2P-Seq     "<incarnation>.<sequence>": incarnation bumped at every start of the sender,
                  sequence counting its requests since that start
    X-P2P-MAC     hex HMAC-SHA256 over a domain tag, method, path, sender, incarnation,
                  sequence and the body

A response carries `X-P2P-Sender` (the responder) and `X-P2P-MAC` over the tag, method, path,
responder, the *request's* sender, incarnation and sequence, the status and the body: it is
bound to the one request it answers, so it cannot be replayed onto another.

Replays are refused without any wall clock (Pis have no real-time clock): for each sender the
receiver keeps the newest incarnation and a sliding window of the sequences seen in it. A
request with an older incarnation, a sequence already seen, or one too far behind the newest
is refused. The window (not "strictly greater") lets concurrent requests of one sender arrive
out of order. Everything is constant-time compared. No I/O, no clock.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

SENDER, SEQ, MAC = "X-P2P-Sender", "X-P2P-Seq", "X-P2P-MAC"
REPLAY_WINDOW = 256  # sequences behind the newest still accepted (once each)
MAX_SENDERS = 8192  # senders remembered; the least recently heard is forgotten first
_REQ_TAG, _RESP_TAG = b"p2ptrain/1 request\n", b"p2ptrain/1 response\n"


class AuthError(Exception):
    """A request or response is not authentic, or is a replay; `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def derive_mac_key(swarm_key: bytes) -> bytes:
    """The HMAC key of a swarm (the swarm key itself never keys anything directly)."""
    if len(swarm_key) != 32:
        raise ValueError("a swarm key is 32 bytes")
    return hashlib.sha256(b"p2ptrain mac key\n" + swarm_key).digest()


def _mac(key: bytes, tag: bytes, fields: tuple[str, ...], body: bytes | memoryview) -> str:
    h = hmac.new(key, tag, hashlib.sha256)
    for field in fields:  # length-prefixed, so no two field lists hash alike
        raw = field.encode()
        h.update(len(raw).to_bytes(4, "big") + raw)
    h.update(body)
    return h.hexdigest()


def _is_node_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True, slots=True)
class RequestId:
    """Who sent an authenticated request, and its (incarnation, sequence)."""

    sender: str
    incarnation: int
    seq: int


class Signer:
    """Signs this node's outgoing requests and checks the responses to them."""

    def __init__(self, mac_key: bytes, node_id: str, incarnation: int):
        if not _is_node_id(node_id) or incarnation < 0:
            raise ValueError("bad node id or incarnation")
        self.key, self.node_id, self.incarnation = mac_key, node_id, incarnation
        self.seq = 0

    def sign_request(self, method: str, path: str, body: bytes | memoryview = b""
                     ) -> tuple[RequestId, dict[str, str]]:
        """Headers for one request (each call uses a new sequence number)."""
        self.seq += 1
        rid = RequestId(self.node_id, self.incarnation, self.seq)
        mac = _mac(self.key, _REQ_TAG, (method, path, rid.sender, str(rid.incarnation),
                                        str(rid.seq)), body)
        return rid, {SENDER: rid.sender, SEQ: f"{rid.incarnation}.{rid.seq}", MAC: mac}

    def check_response(self, method: str, path: str, rid: RequestId, status: int,
                       headers: Mapping[str, str], body: bytes | memoryview) -> str:
        """The responder's node id, if the response is authentic for request `rid`."""
        return check_response(self.key, method, path, rid, status, headers, body)


def check_response(key: bytes, method: str, path: str, rid: RequestId, status: int,
                   headers: Mapping[str, str], body: bytes | memoryview) -> str:
    """The responder's node id, if the response is authentic for request `rid`."""
    responder, mac = headers.get(SENDER, ""), headers.get(MAC, "")
    if not _is_node_id(responder) or not mac:
        raise AuthError("response carries no MAC")
    want = _mac(key, _RESP_TAG, (method, path, responder, rid.sender, str(rid.incarnation),
                                 str(rid.seq), str(status)), body)
    if not hmac.compare_digest(want, mac):
        raise AuthError("response MAC does not verify")
    return responder


def response_headers(key: bytes, responder: str, method: str, path: str, rid: RequestId,
                     status: int, body: bytes | memoryview) -> dict[str, str]:
    """Headers authenticating a response to request `rid`."""
    mac = _mac(key, _RESP_TAG, (method, path, responder, rid.sender, str(rid.incarnation),
                                str(rid.seq), str(status)), body)
    return {SENDER: responder, MAC: mac}


def parse_request(headers: Mapping[str, str]) -> RequestId:
    """The (sender, incarnation, sequence) a request claims; AuthError if absent/malformed."""
    sender, seq = headers.get(SENDER, ""), headers.get(SEQ, "")
    if not headers.get(MAC):
        raise AuthError("request carries no MAC")
    inc_text, _, seq_text = seq.partition(".")
    if not (_is_node_id(sender) and inc_text.isdigit() and seq_text.isdigit()
            and len(inc_text) <= 19 and len(seq_text) <= 19):
        raise AuthError("malformed authentication headers")
    return RequestId(sender, int(inc_text), int(seq_text))


def check_request_mac(key: bytes, method: str, path: str, headers: Mapping[str, str],
                      body: bytes | memoryview) -> RequestId:
    """The request's id if its MAC verifies (replays are `ReplayGuard`'s business)."""
    rid = parse_request(headers)
    want = _mac(key, _REQ_TAG, (method, path, rid.sender, str(rid.incarnation), str(rid.seq)),
                body)
    if not hmac.compare_digest(want, headers.get(MAC, "")):
        raise AuthError("request MAC does not verify (wrong swarm key?)")
    return rid


class ReplayGuard:
    """Per sender: the newest incarnation and the sequences seen near the newest one."""

    def __init__(self, window: int = REPLAY_WINDOW, max_senders: int = MAX_SENDERS):
        self.window, self.max_senders = window, max_senders
        # sender -> (incarnation, newest seq, bitmask of seen seqs: bit i = newest - i)
        self._seen: OrderedDict[str, tuple[int, int, int]] = OrderedDict()

    def check(self, rid: RequestId) -> None:
        """Record `rid`, or raise AuthError if it is a replay or too old. Call only after the
        MAC verified, or a forger could poison the window."""
        entry = self._seen.get(rid.sender)
        if entry is None or rid.incarnation > entry[0]:
            self._remember(rid.sender, (rid.incarnation, rid.seq, 1))
            return
        inc, newest, mask = entry
        if rid.incarnation < inc:
            raise AuthError(f"replay: incarnation {rid.incarnation} is older than {inc}")
        if rid.seq > newest:
            shift = rid.seq - newest
            mask = ((mask << shift) | 1) & ((1 << self.window) - 1) if shift < self.window else 1
            self._remember(rid.sender, (inc, rid.seq, mask))
            return
        behind = newest - rid.seq
        if behind >= self.window:
            raise AuthError(f"replay: sequence {rid.seq} is too far behind {newest}")
        if mask >> behind & 1:
            raise AuthError(f"replay: sequence {rid.seq} was already seen")
        self._remember(rid.sender, (inc, newest, mask | 1 << behind))

    def _remember(self, sender: str, entry: tuple[int, int, int]) -> None:
        self._seen[sender] = entry
        self._seen.move_to_end(sender)
        while len(self._seen) > self.max_senders:
            self._seen.popitem(last=False)


class ServerAuth:
    """A server's side: verify a request (MAC, then replay), sign the response to it."""

    def __init__(self, mac_key: bytes, node_id: str):
        self.key, self.node_id = mac_key, node_id
        self.guard = ReplayGuard()

    def verify(self, method: str, path: str, headers: Mapping[str, str],
               body: bytes | memoryview) -> RequestId:
        """The request's id; AuthError (answer 401, process nothing) otherwise."""
        rid = check_request_mac(self.key, method, path, headers, body)
        self.guard.check(rid)
        return rid

    def sign(self, method: str, path: str, rid: RequestId, status: int,
             body: bytes | memoryview) -> dict[str, str]:
        """Headers authenticating our response to `rid`."""
        return response_headers(self.key, self.node_id, method, path, rid, status, body)
