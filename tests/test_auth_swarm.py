"""The pure parts of the swarm's security: MACs bound to method, path, sender, sequence and
body; replay windows; join tokens and key files."""

from __future__ import annotations

import os
import stat

import pytest

from p2ptrain.net.auth import (
    MAC,
    SEQ,
    AuthError,
    ReplayGuard,
    RequestId,
    ServerAuth,
    Signer,
    derive_mac_key,
)
from p2ptrain.swarm import (
    Swarm,
    SwarmError,
    demo_swarm,
    new_swarm,
    parse_token,
    read_key_file,
    write_init_files,
)

A, B = "a" * 32, "b" * 32


def _pair(key: bytes = b"k" * 32) -> tuple[Signer, ServerAuth]:
    mac = derive_mac_key(key)
    return Signer(mac, A, 3), ServerAuth(mac, B)


def test_a_signed_request_verifies_once_and_its_response_is_bound_to_it():
    signer, server = _pair()
    rid, headers = signer.sign_request("POST", "/v1/gossip", b"body")
    assert server.verify("POST", "/v1/gossip", headers, b"body") == rid
    with pytest.raises(AuthError, match="already seen"):
        server.verify("POST", "/v1/gossip", headers, b"body")
    reply = server.sign("POST", "/v1/gossip", rid, 200, b"answer")
    assert signer.check_response("POST", "/v1/gossip", rid, 200, reply, b"answer") == B
    other, _ = signer.sign_request("POST", "/v1/gossip", b"body")
    for args in [("POST", "/v1/gossip", other, 200, reply, b"answer"),  # another request
                 ("POST", "/v1/gossip", rid, 400, reply, b"answer"),  # another status
                 ("POST", "/v1/gossip", rid, 200, reply, b"answer!"),  # another body
                 ("POST", "/v1/average", rid, 200, reply, b"answer")]:  # another route
        with pytest.raises(AuthError):
            signer.check_response(*args)


@pytest.mark.parametrize("change", ["method", "path", "body", "sender", "seq", "mac", "key"])
def test_any_change_to_a_signed_request_breaks_its_mac(change):
    signer, server = _pair()
    _, headers = signer.sign_request("POST", "/v1/control", b"ping")
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
    else:
        server = ServerAuth(derive_mac_key(b"x" * 32), B)
    with pytest.raises(AuthError):
        server.verify(method, path, headers, body)


@pytest.mark.parametrize("headers", [
    {}, {MAC: "00"}, {MAC: "00", "X-P2P-Sender": A, SEQ: "x.1"},
    {MAC: "00", "X-P2P-Sender": "A" * 32, SEQ: "1.1"}, {MAC: "00", "X-P2P-Sender": A, SEQ: "1"},
    {MAC: "00", "X-P2P-Sender": A, SEQ: "1." + "9" * 30}])
def test_missing_or_malformed_auth_headers_are_refused(headers):
    _, server = _pair()
    with pytest.raises(AuthError):
        server.verify("POST", "/v1/control", headers, b"")


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
