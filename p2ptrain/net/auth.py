"""Message authentication on the MAC routes: HMAC-SHA256 keyed by a *pair key* of the sender's
and the receiver's lives (session.py: the swarm key admits, each member's own keys bind what
it says of itself), bound to the receiver, and replay refusal by per-sender (incarnation,
sequence).

A request carries five headers:

    X-P2P-Version  the sender's protocol version (PROTOCOL_VERSION); checked first
    X-P2P-Sender   the sender's node id (32 hex)
    X-P2P-Seq      "<incarnation>.<sequence>": incarnation bumped at every start of the sender,
                   sequence counting its requests since that start
    X-P2P-To       "<node id>.<incarnation>" of the receiver the request is meant for
    X-P2P-MAC      hex HMAC-SHA256, keyed by the two lives' pair key, over a domain tag (naming
                   the protocol version), method, path, sender, incarnation, sequence,
                   receiver id, receiver incarnation and the body

A response carries `X-P2P-Sender` (the responder) and `X-P2P-MAC` (the same pair key) over the
tag, method, path, the responder's id and incarnation, the *request's* sender, incarnation and
sequence, the status and the body: bound to the one request it answers and to the life that
answered. Naming the receiver's life makes a captured request useless to any later life of
its receiver (its replay window lives in memory), since incarnations only grow.

The hello (hello.py) comes first: `GET /v1/hello` carries a random nonce, the asker's card
(session.py) and a MAC over (sender, nonce, card) with the swarm key; the node checks the card
(its identity key hashes to the sender's id, its signature verifies), keeps the sender's life
and their pair key -- one per swarm key its hellos used, so a hello of the same card under the
other key during a rotation adds a pair and replaces none -- and answers with its id,
incarnation, version and card, MACed with the pair key over the nonce, the asker and the
answer: only the node whose id it names can make it, and an old one cannot be replayed. A
hello of an older life than one seen is refused. The pair key is salted by the node (a salt
in the answer, new whenever it holds no pair of that life and key, the same while it does: a
replayed hello changes nothing). The last `MAX_SENDERS` senders whose requests verified are
kept; one forgotten is forgotten by the replay window too, and its next pair has a new salt,
so a request captured under the old one never verifies again. The cards lately checked are
kept (a hello played again costs no signature check), and a card to check may be refused for
now (`HelloBusy`, 429: hello.py limits them per address). A request from a sender with no
hello in that incarnation is refused before its body, and the sender says hello again (the
outbox, the fetches). Token-only clients say hello under a throwaway identity.

Replays are refused without any wall clock (Pis have no real-time clock): for each sender the
receiver keeps the newest incarnation and a sliding window of the sequences seen in it; an
older incarnation, a sequence already seen or one too far behind the newest is refused. The
window lets concurrent requests of one sender arrive out of order, and a sender numbers its
requests to each receiver on their own (a slow averaging upload is behind only the requests
to the same receiver). Headers are checked before the body is read; the MAC is computed as the
body streams in (`Pending`) and the window records the request only once the MAC verified.
Everything is constant-time compared. No I/O, no clock.

Key rotation (keyring.py): during the grace a node accepts hellos MACed with the current or
the previous key, and a pair key derives from the key its hello verified with (a peer that
answers only to the previous key is reached so). After the grace a request whose pair came
from the previous key is refused, saying the key was rotated; the next hello uses the current.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace

from p2ptrain.net.authbase import (  # noqa: F401 (some re-exported: where they always were)
    _HELLO_TAG,
    _REQ_TAG,
    _WELCOME_TAG,
    CARD,
    MAC,
    MAX_RECEIVERS,
    MAX_SENDERS,
    NONCE,
    SENDER,
    SEQ,
    TO,
    VERSION,
    AuthError,
    HelloBusy,
    Receiver,
    ReplayGuard,
    RequestId,
    VersionError,
    _is_mac,
    _is_node_id,
    _mac,
    _start,
    check_response,
    check_version,
    derive_mac_key,
    parse_request,
    response_headers,
)
from p2ptrain.net.keyring import ROTATED, Keyring, keyring
from p2ptrain.net.session import SALT_BYTES, Card, CardError, Life, salted
from p2ptrain.proto import PROTOCOL_VERSION


class Signer:
    """Signs this node's outgoing requests and checks the responses to them. `keys` is the
    swarm's MAC key, or a Keyring during a key rotation (see the module docstring); `life`
    is this node's life (session.py), whose card every hello carries."""

    def __init__(self, keys: bytes | Keyring, life: Life):
        self.keys = keyring(keys)
        self.life = life
        self.key, self.node_id, self.incarnation = self.keys.current, life.node_id, life.incarnation
        self.seq = 0  # the highest sequence issued, to anyone
        self._seqs: OrderedDict[str, int] = OrderedDict()  # receiver -> its last sequence
        # receiver -> (its incarnation, our pair key, the swarm key the hello verified with)
        self._pairs: OrderedDict[str, tuple[int, bytes, bytes]] = OrderedDict()

    def knows(self, to: Receiver) -> bool:
        """Whether a pair key with that life of the receiver is held and still accepted (the
        swarm key it came from not retired): else say hello again."""
        pair = self._pairs.get(to.node_id)
        return (pair is not None and pair[0] == to.incarnation
                and pair[2] in self.keys.accepted())

    def hello_keys(self) -> tuple[bytes, ...]:
        """The keys a hello may try, in order: the current one, then (during the grace) the
        previous one."""
        return self.keys.accepted()

    def sign_request(self, method: str, path: str, body: bytes | memoryview = b"", *,
                     to: Receiver) -> tuple[RequestId, dict[str, str]]:
        """Headers for one request meant for `to` (each call uses a new sequence number,
        counted per receiver; a receiver new or forgotten continues above every one issued).
        AuthError if no hello with that life of `to` holds a pair key (`knows`)."""
        if not self.knows(to):
            raise AuthError(f"no hello with node {to.node_id} (incarnation {to.incarnation}) "
                            f"yet: say hello first")
        key = self._pairs[to.node_id][1]
        seq = self._seqs.pop(to.node_id, self.seq) + 1
        self._seqs[to.node_id] = seq
        if len(self._seqs) > MAX_RECEIVERS:
            self._seqs.popitem(last=False)
        self.seq = max(self.seq, seq)
        rid = RequestId(self.node_id, self.incarnation, seq, to, key)
        mac = _mac(key, _REQ_TAG, rid.fields(method, path), body)
        return rid, {VERSION: str(PROTOCOL_VERSION), SENDER: rid.sender,
                     SEQ: f"{rid.incarnation}.{rid.seq}", TO: to.header(), MAC: mac}

    def hello_headers(self, nonce: str, key: bytes | None = None) -> dict[str, str]:
        """Headers of a hello request carrying `nonce` (32 hex) and our card, MACed with `key`
        (default: the current key)."""
        card = self.life.card.text()
        return {VERSION: str(PROTOCOL_VERSION), SENDER: self.node_id, NONCE: nonce, CARD: card,
                MAC: _mac(key or self.key, _HELLO_TAG, (self.node_id, nonce, card), b"")}

    def check_welcome(self, nonce: str, headers: Mapping[str, str], body: bytes,
                      key: bytes | None = None) -> Receiver:
        """The node that answered our hello with `nonce` (made with the swarm key `key`,
        default the current one), its pair key now kept; AuthError unless `body` is its
        answer, its card verifies and the answer's MAC is made with our pair key."""
        key = key or self.key
        try:
            doc = json.loads(body)
            node_id, inc, card_text = doc["node_id"], doc["incarnation"], doc["card"]
            salt = bytes.fromhex(doc["salt"]) if isinstance(doc["salt"], str) else b""
        except (ValueError, KeyError, TypeError, RecursionError):
            raise AuthError("malformed hello answer") from None
        receiver = Receiver.parse(f"{node_id}.{inc}") if isinstance(node_id, str) \
            and type(inc) is int else None
        if receiver is None or len(salt) != SALT_BYTES:
            raise AuthError("malformed hello answer")
        try:
            card = Card.parse(card_text, receiver.node_id)
            pair = salted(self.life.pair_key(key, card), salt)
        except CardError as exc:
            raise AuthError(f"hello answer: {exc}") from None
        if card.incarnation != receiver.incarnation:
            raise AuthError("hello answer's card names another life of the node")
        want = _mac(pair, _WELCOME_TAG, (nonce, self.node_id), body)
        mac = headers.get(MAC, "")  # its shape first: compare_digest raises on non-ASCII
        if not (_is_mac(mac) and hmac.compare_digest(want, mac)):
            raise AuthError("hello answer does not verify (not a member of this swarm, or "
                            "not the node it names)")
        self._pairs[receiver.node_id] = (receiver.incarnation, pair, key)
        self._pairs.move_to_end(receiver.node_id)
        while len(self._pairs) > MAX_RECEIVERS:
            self._pairs.popitem(last=False)
        return receiver

    def check_response(self, method: str, path: str, rid: RequestId, status: int,
                       headers: Mapping[str, str], body: bytes | memoryview) -> str:
        """The responder's node id, if the response is authentic for request `rid` (checked
        with the pair key the request was signed with)."""
        assert rid.key is not None
        return check_response(rid.key, method, path, rid, status, headers, body)


class Pending:
    """A request whose headers passed: feed the body as it streams, then `finish`. `pairs`
    are (swarm key, pair key) of the sender's life: one per swarm key its hellos used (two
    during a key rotation's grace), each MAC computed as the body streams."""

    def __init__(self, keys: Keyring, method: str, path: str, rid: RequestId, mac: str,
                 guard: ReplayGuard, pairs: list[tuple[bytes, bytes]],
                 verified: Callable[[str], None] = lambda sender: None):
        self.rid, self._mac, self._guard, self._keys = rid, mac, guard, keys
        self._verified = verified  # told the sender once the MAC verified
        fields = rid.fields(method, path)
        self._hs = [(swarm_key, pair, _start(pair, _REQ_TAG, fields)) for swarm_key, pair in pairs]

    def update(self, piece: bytes | memoryview) -> None:
        for _, _, h in self._hs:
            h.update(piece)

    def finish(self) -> RequestId:
        """The request's id, carrying the pair key it verified with, if the MAC over
        everything fed verifies and the swarm key of that pair's hello is accepted now (then
        it is recorded in the replay window); AuthError otherwise."""
        found = next(((k, pair) for k, pair, h in self._hs
                      if hmac.compare_digest(h.hexdigest(), self._mac)), None)
        if found is None:
            raise AuthError("request MAC does not verify (wrong swarm key, or not the sender "
                            "it names?)")
        if not self._keys.accepts(found[0]):
            raise AuthError(ROTATED)
        self._guard.check(self.rid)
        self._verified(self.rid.sender)
        return replace(self.rid, key=found[1])


class ServerAuth:
    """A server's side: answer hellos (keeping each sender's life and pair key), check a
    request's headers (version, shape, receiver, a hello of that life, replay window), its
    MAC as the body streams, then record it; sign the response to it. `keys` is the swarm's
    MAC key, or a Keyring during a key rotation; `life` is this node's life (session.py)."""

    def __init__(self, keys: bytes | Keyring, life: Life, max_senders: int = MAX_SENDERS):
        self.keys = keyring(keys)
        self.life = life
        self.key, self.node_id, self.incarnation = self.keys.current, life.node_id, life.incarnation
        self.guard = ReplayGuard(max_senders=max_senders)
        self.max_senders = max_senders
        # sender -> (its incarnation, {swarm key its hello verified with: (pair key, salt)}):
        # a pair per swarm key, so a hello made with the other key (during a rotation's
        # grace, anyone's: cards are public) adds a pair and never replaces the one in use.
        # A sender forgotten here is forgotten by the replay window too, and its next pair
        # gets a new salt: a request captured under the old one never verifies again.
        self._pairs: OrderedDict[str, tuple[int, dict[bytes, tuple[bytes, bytes]]]] = \
            OrderedDict()
        # (sender, card text, swarm key) -> (card, pair key): cards checked lately
        self._cards: OrderedDict[tuple[str, str, bytes], tuple[Card, bytes]] = OrderedDict()

    def begin(self, method: str, path: str, headers: Mapping[str, str]) -> Pending:
        """Check everything but the MAC, before any body byte is read; AuthError (401, or
        VersionError: 400) if the request cannot be for us."""
        rid = parse_request(headers)
        assert rid.to is not None
        if rid.to.node_id != self.node_id:
            raise AuthError(f"request is addressed to node {rid.to.node_id}, not to this node "
                            f"({self.node_id})")
        if rid.to.incarnation != self.incarnation:
            raise AuthError(f"request is addressed to incarnation {rid.to.incarnation} of this "
                            f"node, which runs incarnation {self.incarnation} (a replay, or a "
                            f"sender that has not said hello since this node restarted)")
        pair = self._pairs.get(rid.sender)
        if pair is None or pair[0] != rid.incarnation:
            raise AuthError(f"no hello from node {rid.sender} in incarnation {rid.incarnation}"
                            f" here: say hello first")
        self.guard.peek(rid)
        return Pending(self.keys, method, path, rid, headers[MAC], self.guard,
                       [(k, p) for k, (p, _) in pair[1].items()], self._used)

    def _used(self, sender: str) -> None:
        """A request of `sender` verified: it is forgotten after the senders idle longer."""
        if sender in self._pairs:
            self._pairs.move_to_end(sender)

    def _forget_least_recent(self) -> None:
        while len(self._pairs) > self.max_senders:
            sender, _ = self._pairs.popitem(last=False)
            self.guard.forget(sender)

    def verify(self, method: str, path: str, headers: Mapping[str, str],
               body: bytes | memoryview) -> RequestId:
        """The request's id; AuthError (answer 401, process nothing) otherwise."""
        pending = self.begin(method, path, headers)
        pending.update(body)
        return pending.finish()

    def sign(self, method: str, path: str, rid: RequestId, status: int,
             body: bytes | memoryview) -> dict[str, str]:
        """Headers authenticating our response to `rid` (which named us and verified), MACed
        with the pair key the request came in with."""
        assert rid.key is not None, "only a verified request is answered with a MAC"
        return response_headers(rid.key, method, path, rid, status, body)

    def welcome(self, headers: Mapping[str, str],
                allow: Callable[[], bool] = lambda: True) -> tuple[bytes, dict[str, str]]:
        """The answer to a hello request (body, headers): our id, incarnation, protocol
        version, card and the pair's salt, MACed with the pair key over the asker's nonce;
        AuthError if the hello is not authentic (the swarm key's MAC, the asker's card) or
        comes from an older life of its sender than one seen; HelloBusy if a card to check
        is not `allow`ed (a member's flood of hellos: they cost a signature check)."""
        check_version(headers)
        sender, nonce, mac = headers.get(SENDER, ""), headers.get(NONCE, ""), headers.get(MAC, "")
        card_text = headers.get(CARD, "")
        if not mac:
            raise AuthError("request carries no MAC")
        if not (_is_node_id(sender) and _is_node_id(nonce) and _is_mac(mac)
                and card_text.isascii() and 0 < len(card_text) <= 400):
            raise AuthError("malformed hello headers")
        key = next((k for k in self.keys.known() if hmac.compare_digest(
            _mac(k, _HELLO_TAG, (sender, nonce, card_text), b""), mac)), None)
        if key is None:
            raise AuthError("hello MAC does not verify (wrong swarm key?)")
        if not self.keys.accepts(key):
            raise AuthError(ROTATED)
        checked = self._cards.pop((sender, card_text, key), None)
        if checked is None:  # (a hello played again costs no signature check a second time)
            if not allow():
                raise HelloBusy("too many hellos from this address")
            try:
                card = Card.parse(card_text, sender)
                checked = card, self.life.pair_key(key, card)
            except CardError as exc:
                raise AuthError(f"hello: {exc}") from None
        self._cards[(sender, card_text, key)] = checked
        while len(self._cards) > self.max_senders:
            self._cards.popitem(last=False)
        card, pair = checked
        entry = self._pairs.get(sender)
        known = max(-1 if entry is None else entry[0], self.guard.incarnation(sender))
        if card.incarnation < known:  # (worded as the replay window's: refusals.py hints)
            raise AuthError(f"hello of node {sender}: incarnation {card.incarnation} is older "
                            f"than {known}")
        pairs = dict(entry[1]) if entry is not None and entry[0] == card.incarnation else {}
        if key not in pairs:  # held: a replayed hello changes nothing; else a new salt
            salt = secrets.token_bytes(SALT_BYTES)
            pairs[key] = salted(pair, salt), salt
        pair, salt = pairs[key]
        self._pairs[sender] = (card.incarnation, pairs)
        self._pairs.move_to_end(sender)
        self._forget_least_recent()
        body = json.dumps({"node_id": self.node_id, "incarnation": self.incarnation,
                           "version": PROTOCOL_VERSION, "card": self.life.card.text(),
                           "salt": salt.hex()}, separators=(",", ":")).encode()
        return body, {SENDER: self.node_id,
                      MAC: _mac(pair, _WELCOME_TAG, (nonce, sender), body)}
