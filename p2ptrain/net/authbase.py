"""The parts of message authentication that hold no key of their own (auth.py has the signer
and the server's side): header names, the shapes they must have, the MAC function and its
domain tags, who a request is from and meant for, response MACs, and the replay window.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from p2ptrain.proto import PROTOCOL_VERSION

SENDER, SEQ, MAC = "X-P2P-Sender", "X-P2P-Seq", "X-P2P-MAC"
VERSION, TO, NONCE = "X-P2P-Version", "X-P2P-To", "X-P2P-Nonce"
CARD = "X-P2P-Card"  # a hello's card (session.py)
REPLAY_WINDOW = 1024  # sequences behind the newest still accepted (once each)
MAX_SENDERS = 8192  # senders remembered; the least recently heard is forgotten first
MAX_RECEIVERS = 8192  # receivers a signer numbers separately (a forgotten one starts above all)
_TAG = f"p2ptrain/{PROTOCOL_VERSION}"
_REQ_TAG, _RESP_TAG = f"{_TAG} request\n".encode(), f"{_TAG} response\n".encode()
_HELLO_TAG, _WELCOME_TAG = f"{_TAG} hello\n".encode(), f"{_TAG} welcome\n".encode()


class AuthError(Exception):
    """A request or response is not authentic, or is a replay; `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class HelloBusy(AuthError):
    """A hello refused for now (429): too many from its address to check."""


class VersionError(AuthError):
    """The request speaks another protocol version (answered 400, with both versions)."""


def check_version(headers: Mapping[str, str]) -> None:
    """Refuse a request of another protocol version, saying which versions meet. Protocol 1
    had no version header: a request with MAC headers and none is protocol 1."""
    text = headers.get(VERSION)
    if text is None:
        if not headers.get(MAC):
            return  # no credentials at all: the MAC check says so
        theirs = "1"
    elif text.isascii() and text.isdigit() and len(text) <= 6:
        theirs = str(int(text))
    else:
        raise VersionError("malformed protocol version header")
    if theirs != str(PROTOCOL_VERSION):
        raise VersionError(f"this node speaks p2ptrain protocol {PROTOCOL_VERSION}; the request "
                           f"is protocol {theirs}: run the same p2ptrain release on every node")


def derive_mac_key(swarm_key: bytes) -> bytes:
    """The HMAC key of a swarm (the swarm key itself never keys anything directly)."""
    if len(swarm_key) != 32:
        raise ValueError("a swarm key is 32 bytes")
    return hashlib.sha256(b"p2ptrain mac key\n" + swarm_key).digest()


def _start(key: bytes, tag: bytes, fields: tuple[str, ...]):
    h = hmac.new(key, tag, hashlib.sha256)
    for field in fields:  # length-prefixed, so no two field lists hash alike
        raw = field.encode()
        h.update(len(raw).to_bytes(4, "big") + raw)
    return h


def _mac(key: bytes, tag: bytes, fields: tuple[str, ...], body: bytes | memoryview) -> str:
    h = _start(key, tag, fields)
    h.update(body)
    return h.hexdigest()


def _is_node_id(text: str) -> bool:
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def _parse_epoch(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 19 else None


@dataclass(frozen=True, slots=True)
class Receiver:
    """The node a request is meant for, in one life: its id and incarnation (from hello)."""

    node_id: str
    incarnation: int

    def header(self) -> str:
        return f"{self.node_id}.{self.incarnation}"

    @classmethod
    def parse(cls, text: str) -> Receiver | None:
        node_id, _, inc = text.partition(".")
        value = _parse_epoch(inc)
        return cls(node_id, value) if _is_node_id(node_id) and value is not None else None


@dataclass(frozen=True, slots=True)
class RequestId:
    """Who sent an authenticated request, its (incarnation, sequence), and whom it names."""

    sender: str
    incarnation: int
    seq: int
    to: Receiver | None = None
    # the pair key the request was signed or verified with: its response uses the same one
    key: bytes | None = dataclasses.field(default=None, compare=False, repr=False)

    def fields(self, method: str, path: str) -> tuple[str, ...]:
        assert self.to is not None
        return (method, path, self.sender, str(self.incarnation), str(self.seq),
                self.to.node_id, str(self.to.incarnation))


def check_response(key: bytes, method: str, path: str, rid: RequestId, status: int,
                   headers: Mapping[str, str], body: bytes | memoryview) -> str:
    """The responder's node id, if the response is authentic for request `rid`."""
    responder, mac = headers.get(SENDER, ""), headers.get(MAC, "")
    if not _is_node_id(responder) or not _is_mac(mac):  # checked before compare_digest,
        raise AuthError("response carries no MAC")  # which raises TypeError on non-ASCII
    if rid.to is None or responder != rid.to.node_id:
        raise AuthError("response comes from another node than the request named")
    want = _mac(key, _RESP_TAG, _response_fields(method, path, rid, status), body)
    if not hmac.compare_digest(want, mac):
        raise AuthError("response MAC does not verify")
    return responder


def _response_fields(method: str, path: str, rid: RequestId, status: int) -> tuple[str, ...]:
    assert rid.to is not None
    return (method, path, rid.to.node_id, str(rid.to.incarnation), rid.sender,
            str(rid.incarnation), str(rid.seq), str(status))


def response_headers(key: bytes, method: str, path: str, rid: RequestId, status: int,
                     body: bytes | memoryview) -> dict[str, str]:
    """Headers authenticating a response to request `rid` (from the receiver it named)."""
    assert rid.to is not None
    mac = _mac(key, _RESP_TAG, _response_fields(method, path, rid, status), body)
    return {SENDER: rid.to.node_id, MAC: mac}


def _is_mac(text: str) -> bool:
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def parse_request(headers: Mapping[str, str]) -> RequestId:
    """The (sender, incarnation, sequence, receiver) a request claims; AuthError if absent or
    malformed (VersionError if it speaks another protocol version)."""
    check_version(headers)
    sender, seq, mac = headers.get(SENDER, ""), headers.get(SEQ, ""), headers.get(MAC, "")
    if not mac:
        raise AuthError("request carries no MAC")
    inc_text, _, seq_text = seq.partition(".")
    inc, number = _parse_epoch(inc_text), _parse_epoch(seq_text)
    to = Receiver.parse(headers.get(TO, ""))
    if not (_is_node_id(sender) and _is_mac(mac) and inc is not None and number is not None
            and to is not None):
        raise AuthError("malformed authentication headers")
    return RequestId(sender, inc, number, to)


class ReplayGuard:
    """Per sender: the newest incarnation and the sequences seen near the newest one."""

    def __init__(self, window: int = REPLAY_WINDOW, max_senders: int = MAX_SENDERS):
        self.window, self.max_senders = window, max_senders
        # sender -> (incarnation, newest seq, bitmask of seen seqs: bit i = newest - i)
        self._seen: OrderedDict[str, tuple[int, int, int]] = OrderedDict()

    def forget(self, sender: str) -> None:
        self._seen.pop(sender, None)

    def incarnation(self, sender: str) -> int:
        """The newest incarnation of `sender` recorded (-1: none)."""
        entry = self._seen.get(sender)
        return -1 if entry is None else entry[0]

    def peek(self, rid: RequestId) -> None:
        """AuthError if `check` would refuse `rid`; records nothing (safe before the MAC)."""
        entry = self._seen.get(rid.sender)
        if entry is None or rid.incarnation > entry[0]:
            return
        inc, newest, mask = entry
        if rid.incarnation < inc:
            raise AuthError(f"replay: incarnation {rid.incarnation} is older than {inc}")
        if rid.seq <= newest:
            behind = newest - rid.seq
            if behind >= self.window:
                raise AuthError(f"replay: sequence {rid.seq} is too far behind {newest}")
            if mask >> behind & 1:
                raise AuthError(f"replay: sequence {rid.seq} was already seen")

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
