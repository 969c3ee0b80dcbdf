"""The pure parts of the swarm's security: MACs bound to method, path, sender, sequence and
body; replay windows; join tokens and key files."""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import replace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2ptrain.net import auth as auth_module
from p2ptrain.net.auth import (
    CARD,
    MAC,
    SEQ,
    TO,
    VERSION,
    AuthError,
    HelloBusy,
    Receiver,
    ReplayGuard,
    RequestId,
    ServerAuth,
    Signer,
    VersionError,
    derive_mac_key,
)
from p2ptrain.net.session import Card, CardError, Life
from p2ptrain.proto import PROTOCOL_VERSION
from p2ptrain.swarm import (
    Swarm,
    SwarmError,
    demo_swarm,
    new_swarm,
    parse_token,
    read_key_file,
    write_init_files,
)
from tests.helpers import introduce

LIFE_A, LIFE_B = Life.throwaway(3), Life.throwaway(5)
A, B = LIFE_A.node_id, LIFE_B.node_id
TO_B = Receiver(B, 5)


def _pair(key: bytes = b"k" * 32, hello: bool = True) -> tuple[Signer, ServerAuth]:
    mac = derive_mac_key(key)
    signer, server = Signer(mac, LIFE_A), ServerAuth(mac, LIFE_B)
    if hello:
        assert introduce(signer, server) == TO_B
    return signer, server


def test_a_signed_request_verifies_once_and_its_response_is_bound_to_it():
    signer, server = _pair()
    rid, headers = signer.sign_request("POST", "/v1/gossip", b"body", to=TO_B)
    assert server.verify("POST", "/v1/gossip", headers, b"body") == rid
    with pytest.raises(AuthError, match="already seen"):
        server.verify("POST", "/v1/gossip", headers, b"body")
    reply = server.sign("POST", "/v1/gossip", rid, 200, b"answer")
    assert signer.check_response("POST", "/v1/gossip", rid, 200, reply, b"answer") == B
    other, _ = signer.sign_request("POST", "/v1/gossip", b"body", to=TO_B)
    for args in [("POST", "/v1/gossip", other, 200, reply, b"answer"),  # another request
                 ("POST", "/v1/gossip", rid, 400, reply, b"answer"),  # another status
                 ("POST", "/v1/gossip", rid, 200, reply, b"answer!"),  # another body
                 ("POST", "/v1/average", rid, 200, reply, b"answer")]:  # another route
        with pytest.raises(AuthError):
            signer.check_response(*args)


@pytest.mark.parametrize("change", ["method", "path", "body", "sender", "seq", "mac", "key",
                                    "receiver", "receiver incarnation"])
def test_any_change_to_a_signed_request_breaks_its_mac(change):
    signer, server = _pair()
    _, headers = signer.sign_request("POST", "/v1/control", b"ping", to=TO_B)
    method, path, body = "POST", "/v1/control", b"ping"
    if change == "method":
        method = "GET"
    elif change == "path":
        path = "/v1/members"
    elif change == "body":
        body = b"pong"
    elif change == "sender":
        headers["X-P2P-Sender"] = B
    elif change == "seq":
        headers[SEQ] = "3.2"
    elif change == "mac":
        headers[MAC] = "0" * 64
    elif change == "receiver":
        headers[TO] = f"{A}.5"
    elif change == "receiver incarnation":
        headers[TO] = f"{B}.6"
    else:
        server = ServerAuth(derive_mac_key(b"x" * 32), LIFE_B)
    with pytest.raises(AuthError):
        server.verify(method, path, headers, body)


V, M = {VERSION: str(PROTOCOL_VERSION), TO: f"{B}.5"}, "0" * 64


@pytest.mark.parametrize("headers", [
    {}, {**V, MAC: M}, {**V, MAC: M, "X-P2P-Sender": A, SEQ: "x.1"},
    {**V, MAC: M, "X-P2P-Sender": "A" * 32, SEQ: "1.1"}, {**V, MAC: M, "X-P2P-Sender": A, SEQ: "1"},
    {**V, MAC: M, "X-P2P-Sender": A, SEQ: "1." + "9" * 30},
    {**V, MAC: "00", "X-P2P-Sender": A, SEQ: "1.1"},
    {**V, MAC: M, "X-P2P-Sender": A, SEQ: "1.1", TO: B},
    {**V, MAC: M, "X-P2P-Sender": A, SEQ: "1.1", TO: f"{B}.-1"}])
def test_missing_or_malformed_auth_headers_are_refused(headers):
    _, server = _pair()
    with pytest.raises(AuthError):
        server.verify("POST", "/v1/control", headers, b"")


def test_a_request_is_verified_as_its_body_streams_and_recorded_only_if_it_verifies():
    signer, server = _pair()
    body = bytes(range(256)) * 100
    _, headers = signer.sign_request("POST", "/v1/average", body, to=TO_B)
    forged = {**headers, MAC: "f" * 64}
    pending = server.begin("POST", "/v1/average", forged)
    pending.update(body)
    with pytest.raises(AuthError, match="does not verify"):
        pending.finish()
    pending = server.begin("POST", "/v1/average", headers)  # the forgery recorded nothing
    for start in range(0, len(body), 1000):
        pending.update(body[start : start + 1000])
    pending.finish()
    with pytest.raises(AuthError, match="already seen"):  # refused before any body byte
        server.begin("POST", "/v1/average", headers)


def test_other_protocol_versions_are_refused_naming_both():
    signer, server = _pair()
    _, headers = signer.sign_request("POST", "/v1/control", b"x", to=TO_B)
    older, newer = str(PROTOCOL_VERSION - 1), str(PROTOCOL_VERSION + 1)
    for version, theirs in ((None, "1"), ("1", "1"), (older, older), (newer, newer)):
        old = {k: v for k, v in headers.items() if k != VERSION}
        if version is not None:
            old[VERSION] = version
        with pytest.raises(VersionError, match=f"protocol {PROTOCOL_VERSION}; the request is "
                                               f"protocol {theirs}"):
            server.verify("POST", "/v1/control", old, b"x")


def test_a_hello_answer_is_bound_to_the_nonce_and_the_key():
    signer, server = _pair(hello=False)
    nonce = "1" * 32
    body, headers = server.welcome(signer.hello_headers(nonce))
    assert signer.check_welcome(nonce, headers, body) == TO_B
    assert b'"incarnation":5' in body
    with pytest.raises(AuthError):
        signer.check_welcome("2" * 32, headers, body)  # an answer to another hello
    with pytest.raises(AuthError):
        signer.check_welcome(nonce, headers, body.replace(b":5", b":6"))
    stranger = Signer(derive_mac_key(b"x" * 32), Life.throwaway(1))
    with pytest.raises(AuthError, match="wrong swarm key"):
        server.welcome(stranger.hello_headers(nonce))


def test_the_replay_window_accepts_reordering_once_and_refuses_the_old():
    guard = ReplayGuard(window=8)
    for seq in (5, 3, 4, 9, 2):  # out of order, within the window of the newest
        guard.check(RequestId(A, 1, seq))
    for seq in (5, 3, 9):  # each once
        with pytest.raises(AuthError, match="already seen"):
            guard.check(RequestId(A, 1, seq))
    with pytest.raises(AuthError, match="too far behind"):
        guard.check(RequestId(A, 1, 1))  # 9 - 1 >= 8
    guard.check(RequestId(A, 2, 1))  # a restart: new incarnation starts over
    with pytest.raises(AuthError, match="older"):
        guard.check(RequestId(A, 1, 100))  # the previous life cannot speak again
    guard.check(RequestId(B, 1, 1))  # senders are independent


def test_a_jump_past_the_window_forgets_what_it_skipped():
    guard = ReplayGuard(window=4)
    guard.check(RequestId(A, 1, 1))
    guard.check(RequestId(A, 1, 100))
    guard.check(RequestId(A, 1, 98))
    with pytest.raises(AuthError):
        guard.check(RequestId(A, 1, 1))


def test_the_guard_forgets_the_least_recent_sender_past_its_bound():
    guard = ReplayGuard(max_senders=2)
    for sender in (A, B, "c" * 32):
        guard.check(RequestId(sender, 1, 1))
    guard.check(RequestId(A, 1, 1))  # A was forgotten (least recent): bounded memory


def test_tokens_round_trip_and_bad_tokens_say_why():
    swarm = new_swarm("lab-1")
    assert parse_token(swarm.token()) == swarm
    assert swarm.token() not in repr(swarm) and swarm.key.hex() not in repr(swarm)
    assert new_swarm("lab-1").swarm_id != swarm.swarm_id  # a fresh key each time
    assert len(swarm.swarm_id) == 16 and swarm.swarm_id not in swarm.token()
    for bad, why in [("hello", "not a p2ptrain join token"),
                     ("p2pt1.x.AAAA", "key is 3 bytes"),
                     ("p2pt1.bad name.AAAA", "swarm name"),
                     ("p2pt1.x.!!!", "not base64url")]:
        with pytest.raises(SwarmError, match=why):
            parse_token(bad)
    with pytest.raises(SwarmError):
        new_swarm("has.dot")


def test_the_demo_swarm_is_public_and_fixed():
    assert demo_swarm() == demo_swarm() and demo_swarm().is_demo
    assert not new_swarm("x").is_demo


def test_init_files_are_private_and_never_overwritten(tmp_path):
    swarm = new_swarm("fleet")
    key_path, config_path = write_init_files(swarm, tmp_path, "[swarm]\n")
    assert stat.S_IMODE(os.stat(key_path).st_mode) == 0o600
    assert read_key_file(key_path, "fleet") == swarm
    assert config_path.read_text() == "[swarm]\n"
    with pytest.raises(SwarmError, match="already holds a swarm"):
        write_init_files(new_swarm("other"), tmp_path, "")
    assert read_key_file(key_path, "fleet") == swarm
    (tmp_path / "short.key").write_bytes(b"abc")
    with pytest.raises(SwarmError, match="3 bytes"):
        read_key_file(tmp_path / "short.key", "fleet")
    (tmp_path / "token.key").write_text(swarm.token() + "\n")
    assert read_key_file(tmp_path / "token.key", "ignored") == Swarm("fleet", swarm.key)


def test_a_slow_upload_is_behind_only_the_requests_to_the_same_receiver():
    """A sender numbers its requests per receiver: a bulk upload signed first and finished
    last at B is not 'too far behind' because the sender meanwhile sent thousands of requests
    to others (a leader's heartbeats to every member) and a few to B that finished first."""
    signer, server = _pair()
    others = [introduce(signer, ServerAuth(signer.keys.current, Life.throwaway(1)))
              for _ in range(50)]
    _, slow = signer.sign_request("POST", "/v1/average", b"part", to=TO_B)
    for _ in range(40):  # 2,000 requests to 50 other members while the part uploads ...
        for other in others:
            signer.sign_request("POST", "/v1/control", b"beat", to=other)
        rid, fast = signer.sign_request("POST", "/v1/control", b"ping", to=TO_B)  # ... 40 to B
        assert server.verify("POST", "/v1/control", fast, b"ping") == rid
    assert server.verify("POST", "/v1/average", slow, b"part").seq == 1
    # a receiver forgotten (or new) continues above every sequence the signer issued
    issued = signer.seq
    newcomer = introduce(signer, ServerAuth(signer.keys.current, Life.throwaway(1)))
    assert signer.sign_request("POST", "/v1/control", b"", to=newcomer)[0].seq \
        == issued + 1 and issued >= 41


# -- a member speaks only as itself (session.py) ---------------------------------------------


def test_a_member_cannot_sign_as_another_nor_poison_its_replay_window():
    """The attack of protocol 5: a member holding the swarm key signed one request under
    another member's id at incarnation 10^18, and the receiver's replay window then refused
    every request of that member for good. Now the MAC needs the pair key of the named
    member's own life: the forgery is refused, and the member is heard as before."""
    signer, server = _pair()
    mole = Signer(signer.keys.current, Life.throwaway(1))  # a member: it said hello too
    introduce(mole, server)
    forged = RequestId(A, 10**18, 1, TO_B)
    for key in (signer.keys.current, mole._pairs[B][1]):  # the swarm key; the mole's pair key
        mac = auth_module._mac(key, auth_module._REQ_TAG, forged.fields("POST", "/v1/control"),
                               b"ping")
        headers = {VERSION: str(PROTOCOL_VERSION), "X-P2P-Sender": A, SEQ: f"{10**18}.1",
                   TO: TO_B.header(), MAC: mac}
        with pytest.raises(AuthError, match="say hello"):
            server.verify("POST", "/v1/control", headers, b"ping")
        headers[SEQ] = "3.999"  # A's own incarnation: the MAC decides
        with pytest.raises(AuthError, match="does not verify"):
            server.verify("POST", "/v1/control", headers, b"ping")
    rid, headers = signer.sign_request("POST", "/v1/control", b"ping", to=TO_B)
    assert server.verify("POST", "/v1/control", headers, b"ping") == rid  # A is still heard


def test_a_hello_proves_the_sender_and_the_answer_proves_the_node():
    signer, server = _pair(hello=False)
    mole = Signer(signer.keys.current, Life.throwaway(1))
    nonce = secrets.token_hex(16)
    posing = mole.hello_headers(nonce)  # the mole's card under A's id
    posing.update({"X-P2P-Sender": A, MAC: auth_module._mac(
        signer.keys.current, auth_module._HELLO_TAG, (A, nonce, posing[CARD]), b"")})
    with pytest.raises(AuthError, match="not node"):
        server.welcome(posing)
    captured = signer.hello_headers(nonce)  # A's own hello, played again by the mole: the
    body, headers = server.welcome(captured)  # same pair key, which the mole cannot make
    assert signer.check_welcome(nonce, headers, body) == TO_B
    server.welcome(captured)
    rid, sent = signer.sign_request("POST", "/v1/control", b"ping", to=TO_B)
    assert server.verify("POST", "/v1/control", sent, b"ping") == rid
    # the mole answering a hello (at an address said to be B's) can name only itself
    impostor = ServerAuth(signer.keys.current, mole.life)
    body, headers = impostor.welcome(signer.hello_headers(nonce))
    with pytest.raises(AuthError, match="not node"):
        signer.check_welcome(nonce, headers, body.replace(mole.node_id.encode(), B.encode()))
    assert signer.check_welcome(nonce, headers, body).node_id == mole.node_id


def test_a_hello_of_an_older_life_is_refused_and_a_forgotten_sender_says_hello_again():
    key = derive_mac_key(b"k" * 32)
    server = ServerAuth(key, LIFE_B, max_senders=2)
    identity = Ed25519PrivateKey.generate()
    older, newer = (Signer(key, Life.throwaway(i, identity)) for i in (3, 4))
    nonce = secrets.token_hex(16)
    old_hello = older.hello_headers(nonce)
    introduce(newer, server)
    with pytest.raises(AuthError, match="older than 4"):
        server.welcome(old_hello)
    rid, sent = newer.sign_request("POST", "/v1/control", b"x", to=TO_B)
    assert server.verify("POST", "/v1/control", sent, b"x") == rid
    for _ in range(2):  # two other senders: the least recent is forgotten
        introduce(Signer(key, Life.throwaway(1)), server)
    _, sent = newer.sign_request("POST", "/v1/control", b"x", to=TO_B)
    with pytest.raises(AuthError, match="say hello"):
        server.verify("POST", "/v1/control", sent, b"x")
    introduce(newer, server)  # what the outbox does on a 401: hello, then once more
    rid, sent = newer.sign_request("POST", "/v1/control", b"x", to=TO_B)
    assert server.verify("POST", "/v1/control", sent, b"x") == rid


@pytest.mark.parametrize("change", ["id", "incarnation", "signature", "shape", "low order"])
def test_a_bad_card_is_refused(change):
    life = Life.throwaway(7)
    text, node_id = life.card.text(), life.node_id
    inc, identity, exchange, signature = text.split(".")
    if change == "id":
        node_id = LIFE_A.node_id
    elif change == "incarnation":
        text = ".".join(("8", identity, exchange, signature))
    elif change == "signature":
        text = ".".join((inc, identity, exchange, "0" * 128))
    elif change == "shape":
        text = text + ".00"
    else:  # a valid signature over an X25519 point that gives no secret
        with pytest.raises(CardError, match="no shared secret"):
            LIFE_A.pair_key(b"k" * 32, replace(life.card, exchange=bytes(32)))
        return
    with pytest.raises(CardError):
        Card.parse(text, node_id)
    assert Card.parse(life.card.text(), life.node_id) == life.card


def _two_senders() -> tuple[ServerAuth, Signer, Signer]:
    """A node that keeps two senders, and two senders that said hello to it."""
    key = derive_mac_key(b"k" * 32)
    server = ServerAuth(key, LIFE_B, max_senders=2)
    senders = Signer(key, Life.throwaway(1)), Signer(key, Life.throwaway(1))
    for sender in senders:
        introduce(sender, server)
    return server, *senders


def test_a_sender_in_use_is_forgotten_after_idle_ones():
    server, busy, idle = _two_senders()
    key = server.key
    _, sent = busy.sign_request("POST", "/v1/control", b"x", to=TO_B)
    server.verify("POST", "/v1/control", sent, b"x")  # busy is the most recent now
    introduce(Signer(key, Life.throwaway(1)), server)  # a third: the idle one goes
    rid, sent = busy.sign_request("POST", "/v1/control", b"x", to=TO_B)
    assert server.verify("POST", "/v1/control", sent, b"x") == rid
    _, sent = idle.sign_request("POST", "/v1/control", b"x", to=TO_B)
    with pytest.raises(AuthError, match="say hello"):
        server.verify("POST", "/v1/control", sent, b"x")


def test_a_hello_played_again_costs_no_second_signature_check(monkeypatch):
    signer, server = _pair(hello=False)
    checked = []
    parse = Card.parse

    def counting(text, node_id):
        checked.append(node_id)
        return parse(text, node_id)

    monkeypatch.setattr("p2ptrain.net.auth.Card.parse", counting)
    headers = signer.hello_headers(secrets.token_hex(16))
    for _ in range(3):
        server.welcome(headers)
    assert checked == [A]
    server.welcome(Signer(signer.keys.current, Life.throwaway(1)).hello_headers("1" * 32))
    assert len(checked) == 2  # another card is checked


def test_a_captured_request_is_refused_after_its_sender_was_forgotten():
    """A node forgets senders past `max_senders` -- their pair and their replay window
    together. The pair key used to depend on the two lives only, so a hello of the same card
    (the victim's own, or anyone replaying it) brought it back, and a captured request of the
    victim verified a second time. Now each new pair has a new salt from the node."""
    key = derive_mac_key(b"k" * 32)
    server = ServerAuth(key, LIFE_B, max_senders=2)
    victim = Signer(key, Life.throwaway(1))
    captured_hello = victim.hello_headers(secrets.token_hex(16))
    introduce(victim, server)
    rid, captured = victim.sign_request("POST", "/v1/control", b"transfer", to=TO_B)
    server.verify("POST", "/v1/control", captured, b"transfer")
    with pytest.raises(AuthError, match="already seen"):
        server.verify("POST", "/v1/control", captured, b"transfer")
    for _ in range(2):  # members the node hears from since: the victim is forgotten
        other = Signer(key, Life.throwaway(1))
        introduce(other, server)
        _, sent = other.sign_request("POST", "/v1/control", b"x", to=TO_B)
        server.verify("POST", "/v1/control", sent, b"x")
    server.welcome(captured_hello)  # the victim's card again
    with pytest.raises(AuthError, match="does not verify"):
        server.verify("POST", "/v1/control", captured, b"transfer")
    introduce(victim, server)  # the victim itself goes on under its new pair
    rid, sent = victim.sign_request("POST", "/v1/control", b"x", to=TO_B)
    assert server.verify("POST", "/v1/control", sent, b"x") == rid


def test_only_a_verified_request_keeps_its_sender_remembered():
    server, first, _ = _two_senders()
    key = server.key
    _, forged = first.sign_request("POST", "/v1/control", b"x", to=TO_B)
    forged[MAC] = "0" * 64  # names `first`, does not verify: must not refresh it
    with pytest.raises(AuthError, match="does not verify"):
        server.verify("POST", "/v1/control", forged, b"x")
    introduce(Signer(key, Life.throwaway(1)), server)  # a third: the least recent goes
    _, sent = first.sign_request("POST", "/v1/control", b"x", to=TO_B)
    with pytest.raises(AuthError, match="say hello"):
        server.verify("POST", "/v1/control", sent, b"x")


def test_a_card_to_check_may_be_refused_for_now_but_not_a_stranger_or_a_replay():
    signer, server = _pair(hello=False)
    asked = []

    def busy() -> bool:
        asked.append(1)
        return False

    stranger = Signer(derive_mac_key(b"x" * 32), Life.throwaway(1))
    with pytest.raises(AuthError, match="wrong swarm key"):
        server.welcome(stranger.hello_headers("1" * 32), allow=busy)
    assert asked == []  # a stranger spends no budget
    headers = signer.hello_headers("2" * 32)
    with pytest.raises(HelloBusy):
        server.welcome(headers, allow=busy)
    assert asked == [1] and not server._pairs
    server.welcome(headers)
    server.welcome(headers, allow=busy)  # the card is checked already: no budget needed
    assert asked == [1]
