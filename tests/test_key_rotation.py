"""Swarm key rotation, without processes: the keyring's grace on a fake clock; a node holding
the new and the previous key accepts both within the grace, answers each request with the
key it came in with, and refuses the previous one after the grace saying the key was rotated;
hello and mDNS during the grace; checkpoints (signed by the leader's identity, not the swarm
key) fetched across a rotation."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2ptrain.checkpoint import store
from p2ptrain.identity import load_or_create
from p2ptrain.net.auth import (
    AuthError,
    Receiver,
    ServerAuth,
    Signer,
    check_response,
    derive_mac_key,
)
from p2ptrain.net.ckptserve import Serving, add_checkpoint_routes
from p2ptrain.net.discovery import Discovery
from p2ptrain.net.fetch import FetchError, fetch_latest
from p2ptrain.net.hello import HelloError, HelloRefused, add_hello_route, hello
from p2ptrain.net.keyring import ROTATED, SAVE_EVERY, Keyring
from p2ptrain.net.refusals import _cause
from p2ptrain.net.session import Life
from p2ptrain.net.shelf import Shelf
from tests.helpers import introduce
from tests.test_ckptfetch import save_checkpoint, serving
from tests.test_discovery import _advert

LIFE_A, LIFE_B = Life.throwaway(1), Life.throwaway(5)
A, B = LIFE_A.node_id, LIFE_B.node_id
TO_B = Receiver(B, 5)
GRACE = 8.0


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def rotated(clock: Clock, **kw) -> tuple[bytes, bytes, Keyring]:
    """(new MAC key, previous MAC key, a keyring holding both with an 8 s grace)."""
    new, old = derive_mac_key(secrets.token_bytes(32)), derive_mac_key(secrets.token_bytes(32))
    return new, old, Keyring(new, old, GRACE, clock=clock, **kw)


def test_the_grace_is_counted_in_running_time_reported_and_ended_once():
    clock, used, ended = Clock(), [], []
    new, old, keys = rotated(clock, used=2.0, on_used=used.append,
                             on_retired=lambda: ended.append(clock.t))
    assert keys.accepted() == (new, old) and keys.grace_left() == pytest.approx(6.0)
    clock.t += 5.9
    assert keys.accepts(old) and keys.in_grace() and ended == []
    clock.t += 0.2  # 2 s of an earlier life + 6.1 s of this one
    assert not keys.accepts(old) and keys.accepts(new)
    assert keys.accepted() == (new,) and keys.known() == (new, old)
    assert ended == [pytest.approx(106.1)] and used == [GRACE]
    assert not keys.in_grace() and len(ended) == 1  # said once
    long = Keyring(new, old, 60.0, clock=clock, on_used=used.append)
    clock.t += SAVE_EVERY + 1
    assert long.in_grace() and used[-1] == pytest.approx(SAVE_EVERY + 1)
    assert Keyring(new, old, 60.0, used=60.0).retired  # an earlier life used it all
    assert Keyring(new, new, 60.0).previous is None  # "rotated" to the same key: nothing


def test_both_keys_are_accepted_in_the_grace_and_answered_with_the_requests_key():
    clock = Clock()
    new, old, keys = rotated(clock)
    server = ServerAuth(keys, LIFE_B)
    for key in (new, old):  # a restarted member, a member that has only the old key
        signer = Signer(key, Life.throwaway(1))
        assert introduce(signer, server) == TO_B  # a hello made with that swarm key
        rid, headers = signer.sign_request("POST", "/v1/gossip", b"grad", to=TO_B)
        got = server.verify("POST", "/v1/gossip", headers, b"grad")
        assert got == rid and got.key == rid.key and got.key not in (new, old)  # a pair key
        reply = server.sign("POST", "/v1/gossip", got, 200, b"answer")
        assert signer.check_response("POST", "/v1/gossip", rid, 200, reply, b"answer") == B
        for other in (new, old):  # answered with the pair key, not a swarm key
            with pytest.raises(AuthError):
                check_response(other, "POST", "/v1/gossip", rid, 200, reply, b"answer")
    assert "key" not in repr(got) and new.hex() not in repr(got)


def test_the_previous_key_is_refused_after_the_grace_saying_it_was_rotated():
    clock = Clock()
    new, old, keys = rotated(clock)
    server = ServerAuth(keys, LIFE_B)
    old_member, new_member = Signer(old, Life.throwaway(1)), Signer(new, Life.throwaway(1))
    introduce(old_member, server)
    introduce(new_member, server)
    clock.t += GRACE
    _, headers = old_member.sign_request("POST", "/v1/control", b"probe", to=TO_B)
    pending = server.begin("POST", "/v1/control", headers)  # headers pass; the MAC decides
    pending.update(b"probe")
    with pytest.raises(AuthError, match="swarm key was rotated") as refused:
        pending.finish()
    assert refused.value.reason == ROTATED
    with pytest.raises(AuthError, match="swarm key was rotated"):
        server.welcome(old_member.hello_headers(secrets.token_hex(16)))
    _, headers = old_member.sign_request("POST", "/v1/control", b"probe", to=TO_B)
    server.begin("POST", "/v1/control", headers)  # the refusal recorded nothing
    rid, headers = new_member.sign_request("POST", "/v1/control", b"probe", to=TO_B)
    assert server.verify("POST", "/v1/control", headers, b"probe") == rid
    stranger = Signer(derive_mac_key(b"x" * 32), Life.throwaway(2))
    with pytest.raises(AuthError, match="wrong swarm key"):
        server.welcome(stranger.hello_headers(secrets.token_hex(16)))
    with pytest.raises(AuthError, match="say hello"):  # no hello, no pair key
        stranger.sign_request("POST", "/v1/control", b"probe", to=TO_B)


def test_a_rotated_node_reaches_with_the_previous_key_only_who_needs_it():
    clock = Clock()
    new, old, keys = rotated(clock)
    signer = Signer(keys, LIFE_A)
    assert signer.hello_keys() == (new, old)
    not_restarted = ServerAuth(old, LIFE_B)  # B holds only the previous key
    with pytest.raises(AuthError, match="wrong swarm key"):
        not_restarted.welcome(signer.hello_headers(secrets.token_hex(16)))
    nonce = secrets.token_hex(16)
    body, headers = not_restarted.welcome(signer.hello_headers(nonce, old))
    assert signer.check_welcome(nonce, headers, body, old) == TO_B
    rid, sent = signer.sign_request("GET", "/v1/config", to=TO_B)
    assert not_restarted.verify("GET", "/v1/config", sent, b"") == rid
    restarted = ServerAuth(new, Life.throwaway(1))
    rid, sent = signer.sign_request("GET", "/v1/config", to=introduce(signer, restarted))
    assert restarted.verify("GET", "/v1/config", sent, b"") == rid
    clock.t += GRACE  # the previous key's pair keys are given up with it
    assert not signer.knows(TO_B) and signer.hello_keys() == (new,)
    with pytest.raises(AuthError, match="say hello"):
        signer.sign_request("GET", "/v1/config", to=TO_B)


def test_hello_falls_back_to_the_previous_key_during_the_grace_only():
    clock = Clock()
    new, old, keys = rotated(clock)
    old_life = Life.throwaway(7)
    old_node = ServerAuth(old, old_life)  # a member not restarted yet

    async def ask(signer: Signer) -> Receiver:
        app = web.Application()
        add_hello_route(app, old_node)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            return await hello(session, base, signer)

    signer = Signer(keys, LIFE_A)
    assert asyncio.run(ask(signer)) == Receiver(old_life.node_id, 7)
    assert signer.knows(Receiver(old_life.node_id, 7))
    clock.t += GRACE
    with pytest.raises(HelloRefused, match="401"):
        asyncio.run(ask(signer))


def test_mdns_takes_the_previous_swarm_id_during_the_grace():
    clock = Clock()
    new_id, old_id = secrets.token_hex(8), secrets.token_hex(8)
    keys = Keyring(b"n" * 32, b"o" * 32, GRACE, clock=clock, ids=(new_id, old_id))
    peer = secrets.token_hex(16)
    d = Discovery(swarm_id=new_id, node_id=secrets.token_hex(16), port=7100,
                  addresses=None, device_class="test", on_found=lambda a, n: None,
                  interfaces=["127.0.0.1"], accept=keys.accepts_swarm_id)
    props = {"v": "1", "node": peer, "port": "7300", "class": "pi4"}
    for swarm in (new_id, old_id):
        assert d._peer_of(_advert(["10.0.0.2"], swarm=swarm, **props)) == ("10.0.0.2:7300", peer)
    assert d._peer_of(_advert(["10.0.0.2"], swarm=secrets.token_hex(8), **props)) \
        == "other_swarm"
    clock.t += GRACE
    assert d._peer_of(_advert(["10.0.0.2"], swarm=old_id, **props)) == "other_swarm"
    assert d._peer_of(_advert(["10.0.0.2"], swarm=new_id, **props)) == ("10.0.0.2:7300", peer)


def test_checkpoints_stay_valid_across_a_rotation(tmp_path):
    """The manifest is signed by the leader's Ed25519 identity; the swarm key only MACs the
    transfer. A checkpoint written before the rotation is fetched and verified with the new
    key, with the old one during the grace, and not with the old one after."""
    clock = Clock()
    new, old, keys = rotated(clock)
    ident = load_or_create(tmp_path / "leader")
    path = save_checkpoint(tmp_path / "leader" / "checkpoints", ident)  # before the rotation
    auth = ServerAuth(keys, Life(ident))

    async def fetch(key: bytes, out: Path) -> Path:
        app = web.Application()
        add_hello_route(app, auth)
        add_checkpoint_routes(app, Serving(Shelf(lambda: [path.parent]), auth))
        async with serving(app) as base, aiohttp.ClientSession() as session:
            return await fetch_latest(session, base, Signer(key, Life.throwaway(1)), out,
                                      expected_leader=ident.node_id)

    for i, key in enumerate((new, old)):
        got = asyncio.run(fetch(key, tmp_path / f"out{i}"))
        assert store.read_manifest(got) == store.read_manifest(path)
    clock.t += GRACE
    with pytest.raises(FetchError, match="401.*swarm key was rotated"):
        asyncio.run(fetch(old, tmp_path / "late"))


def test_a_hello_replayed_with_the_other_key_does_not_cut_a_member_off():
    """During the grace every member holds both keys and cards are public (each member sees
    the victim's in the victim's hello to it): a hello of the victim's card MACed with the
    previous key replaced the victim's pair made with the current key, and every request of
    the victim then failed -- each retry after a new hello too, in a loop. Now a node keeps a
    pair per swarm key: the replay adds one the victim does not use."""
    clock = Clock()
    new, old, keys = rotated(clock)
    server = ServerAuth(keys, LIFE_B)
    victim = Signer(keys, Life.throwaway(1))
    introduce(victim, server)  # with the current key
    replayed = victim.hello_headers(secrets.token_hex(16), old)  # anyone can make this one
    for _ in range(3):
        server.welcome(replayed)
        rid, sent = victim.sign_request("POST", "/v1/control", b"ping", to=TO_B)
        assert server.verify("POST", "/v1/control", sent, b"ping") == rid


def test_a_hello_from_an_older_life_says_restored_from_a_backup(tmp_path):
    """A node started from a backup of its state directory (an older incarnation) is refused
    at the hello; the reason must lead to the backup hint (refusals.py), not to "is this the
    right swarm key?"."""
    identity = Ed25519PrivateKey.generate()
    node = ServerAuth(derive_mac_key(b"k" * 32), Life.throwaway(7))

    async def ask(incarnation: int) -> Receiver:
        app = web.Application()
        add_hello_route(app, node)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            return await hello(session, base, Signer(node.key, Life.throwaway(incarnation,
                                                                             identity)))

    assert asyncio.run(ask(5)).node_id == node.node_id
    with pytest.raises(HelloRefused) as refused:
        asyncio.run(ask(3))  # the backup
    reason = str(refused.value)
    assert "incarnation 3 is older than 5" in reason and "right swarm key" not in reason
    assert "restored from a backup" in _cause(reason) and "write 6" in _cause(reason)


def test_a_hello_the_server_does_not_allow_is_answered_429_before_any_check():
    node = ServerAuth(derive_mac_key(b"k" * 32), Life.throwaway(1))
    asked = []

    async def ask() -> str:
        app = web.Application()
        add_hello_route(app, node, allow=lambda addr: asked.append(addr) or False)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            with pytest.raises(HelloError) as refused:
                await hello(session, base, Signer(node.key, Life.throwaway(1)))
            return str(refused.value)

    reason = asyncio.run(ask())
    assert "HTTP 429" in reason and "too many hellos" in reason and asked == ["127.0.0.1"]
    assert not node._pairs  # nothing kept
