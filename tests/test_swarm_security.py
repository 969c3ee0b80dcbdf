"""Hostile input against live nodes: every bad request is refused with the right 4xx (or
rejected by the checkpoint fetcher), the node keeps working, and nothing it holds moves.

Part 1 runs a real `Runtime` inside the test's event loop (real aiohttp server on 127.0.0.1,
port 0), held in its join phase so that no step runs: its parameters must stay bit-identical
unless a request changes them. The test plays a peer with its own node id and the swarm key,
joins the way a real peer does (a member-list exchange carrying the node's fingerprint, which
the node itself tells a stranger in its 409 refusal) and then sends bad requests. Every bad
gossip message carries a *poisoned header* (a huge sample count, a ghost member, a ghost
leader of term 10^6, a jump in the liveness beat): had the node looked at the header of a body
it refused, the member table, the sample counter or the election would show it.
Part 2 sends the same burst to a process of a training 2-node swarm; part 3 checks that the
fetcher refuses a corrupted checkpoint and manifests signed by someone else than the leader.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import xxhash

from p2ptrain import checkpoint
from p2ptrain.codecs import HEADER_SIZE, TRAILER_SIZE, encode_vector, make_codec
from p2ptrain.config import resolve, settings_of, swarm_options
from p2ptrain.models import build_model
from p2ptrain.net import auth as auth_module
from p2ptrain.net.auth import Receiver, RequestId, Signer, derive_mac_key
from p2ptrain.net.ckptserve import is_checkpoint_name
from p2ptrain.net.fetch import FetchError, fetch_latest
from p2ptrain.net.hello import hello
from p2ptrain.net.runtime import Runtime
from p2ptrain.net.session import Life
from p2ptrain.proto import wire
from p2ptrain.proto.gossip.messages import GradientPush
from p2ptrain.proto.messages import (
    PROTOCOL_VERSION,
    Ack,
    Envelope,
    Header,
    Ping,
    Refuse,
    SyncReply,
    SyncRequest,
)
from p2ptrain.proto.records import ALIVE, LeaderView, MemberInfo, Update
from p2ptrain.report import Reporter
from p2ptrain.swarm import Swarm, new_swarm
from tests.helpers import run_cli
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]

GOSSIP, CONTROL, MEMBERS = "/v1/gossip", "/v1/control", "/v1/members"
GOSSIP_LIMIT, CONTROL_LIMIT = 32 << 20, 1 << 20  # server.ROUTES, restated on purpose


# -- a peer played by the test ----------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Any

    @property
    def reason(self) -> str:
        try:
            return str(json.loads(self.body)["error"])
        except (ValueError, KeyError, TypeError):
            return ""

    def frames(self) -> list[Envelope]:
        return [wire.decode(f) for f in wire.split(self.body)]


def random_id() -> str:
    return secrets.token_hex(16)


def gradient_chunk(sender: str, values: np.ndarray, *, samples: int = 0,
                   weight: float = 8.0) -> bytes:
    """One codec chunk message (codec none: raw float32, the test swarms' codec) of a whole
    gradient vector."""
    (msg,) = encode_vector(make_codec("none"), values, sender_id=bytes.fromhex(sender),
                           swarm_samples=samples, weight=weight, seed=1)
    return bytes(msg)


def with_payload(chunk: bytes, offset: int, raw: bytes, fix_checksum: bool = True) -> bytes:
    """`chunk` with payload bytes replaced (checksum recomputed unless told otherwise)."""
    out = bytearray(chunk)
    out[HEADER_SIZE + offset : HEADER_SIZE + offset + len(raw)] = raw
    if fix_checksum:
        digest = xxhash.xxh3_64_intdigest(bytes(out[:-TRAILER_SIZE]))
        struct.pack_into("<Q", out, len(out) - TRAILER_SIZE, digest)
    return bytes(out)


class FakePeer:
    """A peer of the swarm, speaking the wire protocol by hand: it never listens (it says it is
    outbound-only, so the node neither probes it nor pushes to it)."""

    def __init__(self, session: aiohttp.ClientSession, addr: str, swarm: Swarm,
                 victim: str | None = None):
        self.session, self.addr, self.swarm = session, addr, swarm
        self.signer = Signer(derive_mac_key(swarm.key), Life.throwaway(1))
        self.node_id = self.signer.node_id
        self.beat = 0
        self.fingerprint, self.fields, self.target = "0" * 16, {}, ""
        self.ghost = random_id()
        self.victim = victim or self.ghost  # a member it poses as (auth_cases)
        self.receiver: Receiver | None = None  # who the node is (learnt by hello)

    async def meet(self) -> None:
        """Learn the node's id and incarnation, as every sender does before its requests."""
        self.receiver = await hello(self.session, f"http://{self.addr}", self.signer)

    def info(self, node_id: str | None = None, outbound_only: bool = True) -> MemberInfo:
        return MemberInfo(node_id or self.node_id, "127.0.0.1:9", "test", 1.0, 0,
                          self.fingerprint, dict(self.fields), outbound_only)

    def header(self, **changes: Any) -> Header:
        self.beat += 1
        return replace(Header(PROTOCOL_VERSION, self.node_id, 1, "127.0.0.1:9", self.fingerprint,
                              0, self.beat, 2, None, ()), **changes)

    def poison(self) -> dict[str, Any]:
        """Header fields that would visibly change the node if it processed the header."""
        ghost = Update(ALIVE, self.ghost, 1, self.ghost, self.info(self.ghost, False))
        return dict(samples=10**9, beat=10**6, live=64, updates=(ghost,),
                    view=LeaderView(10**6, self.ghost, 2**31 - 1, 1e9, 7))

    def frame(self, body: Any, **changes: Any) -> bytes:
        return wire.encode(Envelope(self.header(**changes), body))

    def sign(self, route: str, data: bytes, signer: Signer | None = None
             ) -> tuple[Any, dict[str, str]]:
        assert self.receiver is not None, "meet() first"
        rid, headers = (signer or self.signer).sign_request("POST", route, data,
                                                            to=self.receiver)
        return rid, {**headers, "Content-Type": "application/octet-stream"}

    async def send(self, route: str, data: bytes, headers: dict[str, str]) -> Answer:
        async with self.session.post(f"http://{self.addr}{route}", data=data, headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=30)) as resp:
            return Answer(resp.status, await resp.read(), resp.headers)

    async def post(self, route: str, data: bytes, signer: Signer | None = None) -> Answer:
        """A signed POST; the answer's MAC is checked (refusals after auth are signed too)."""
        if signer is not None and not signer.knows(self.receiver):
            await hello(self.session, f"http://{self.addr}", signer)
        rid, headers = self.sign(route, data, signer)
        answer = await self.send(route, data, headers)
        (signer or self.signer).check_response("POST", route, rid, answer.status,
                                               answer.headers, answer.body)
        return answer

    async def join(self) -> str:
        """Learn the node's fingerprint from its refusal (409), then join as a real peer;
        the refusal's reason."""
        await self.meet()
        stranger = SyncRequest((Update(ALIVE, self.node_id, 1, self.node_id, self.info()),), {})
        answer = await self.post(MEMBERS, self.frame(stranger))
        assert answer.status == 409, (answer.status, answer.body[:200])
        (refusal,) = answer.frames()
        assert isinstance(refusal.body, Refuse), refusal
        self.fingerprint, self.target = refusal.header.fingerprint, refusal.header.sender
        self.fields = dict(refusal.body.fingerprint_fields)
        listing = SyncRequest((Update(ALIVE, self.node_id, 1, self.node_id, self.info()),), {})
        answer = await self.post(MEMBERS, self.frame(listing, live=1))
        assert answer.status == 200, (answer.status, answer.reason)
        assert any(isinstance(e.body, SyncReply) for e in answer.frames())
        return refusal.body.reason

    async def ping(self) -> None:
        """A valid probe: the node must answer with an Ack (it still works, and hears us)."""
        answer = await self.post(CONTROL, self.frame(Ping(self.beat, self.target)))
        assert answer.status == 200, (answer.status, answer.reason)
        assert [type(e.body) for e in answer.frames()] == [Ack], answer.frames()


async def raw_http(addr: str, request: bytes, timeout: float = 10.0) -> Answer:
    """Write `request` as is on a new connection and read one response (Content-Length)."""
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        body = await asyncio.wait_for(
            reader.readexactly(int(headers.get("content-length", 0))), timeout)
        return Answer(status, body, headers)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


def post_head(addr: str, route: str, length_header: str) -> bytes:
    return (f"POST {route} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/octet-stream"
            f"\r\n{length_header}\r\n\r\n").encode()


# -- the bad requests (shared by parts 1 and 2) -----------------------------------------------

@dataclass(frozen=True)
class Case:
    """A bad request and how it must be refused."""

    name: str
    status: int  # the HTTP status it must get
    reason: str  # a part of the refusal's reason
    send: Callable[[], Awaitable[Answer]]
    prepare: Callable[[], Awaitable[None]] | None = None  # a valid request it builds on


def auth_cases(peer: FakePeer) -> list[Case]:
    def no_mac() -> Awaitable[Answer]:
        return peer.send(CONTROL, peer.frame(Ping(1, peer.target)),
                         {"Content-Type": "application/octet-stream"})

    async def get_hello(headers: dict[str, str]) -> Answer:
        async with peer.session.get(f"http://{peer.addr}/v1/hello", headers=headers) as resp:
            return Answer(resp.status, await resp.read(), resp.headers)

    def wrong_key() -> Awaitable[Answer]:  # a stranger cannot even say hello
        other = Signer(derive_mac_key(secrets.token_bytes(32)), Life.throwaway(1))
        return get_hello(other.hello_headers(secrets.token_hex(16)))

    async def posing() -> Answer:
        """A member signs a request under another member's id, at an incarnation of 10^18,
        with the swarm key: had the node taken it, its replay window would refuse that
        member's own requests for good."""
        assert peer.receiver is not None
        data = peer.frame(Ping(1, peer.target), sender=peer.victim)
        rid = RequestId(peer.victim, 10**18, 1, peer.receiver)
        mac = auth_module._mac(derive_mac_key(peer.swarm.key), auth_module._REQ_TAG,
                               rid.fields("POST", CONTROL), data)
        return await peer.send(CONTROL, data, {
            "X-P2P-Version": str(PROTOCOL_VERSION), "X-P2P-Sender": peer.victim,
            "X-P2P-Seq": f"{10**18}.1", "X-P2P-To": peer.receiver.header(), "X-P2P-MAC": mac,
            "Content-Type": "application/octet-stream"})

    def posing_hello() -> Awaitable[Answer]:  # its own card under the other's id
        headers = peer.signer.hello_headers(secrets.token_hex(16))
        card, nonce = headers["X-P2P-Card"], headers["X-P2P-Nonce"]
        return get_hello({**headers, "X-P2P-Sender": peer.victim, "X-P2P-MAC": auth_module._mac(
            derive_mac_key(peer.swarm.key), auth_module._HELLO_TAG, (peer.victim, nonce, card),
            b"")})

    sent: list[tuple[bytes, dict[str, str]]] = []

    async def send_once() -> None:
        data = peer.frame(Ping(1, peer.target))
        headers = peer.sign(CONTROL, data)[1]
        first = await peer.send(CONTROL, data, headers)
        assert first.status == 200, (first.status, first.reason)
        sent.append((data, headers))

    def replayed() -> Awaitable[Answer]:
        return peer.send(CONTROL, *sent.pop())

    async def altered() -> Answer:
        data = peer.frame(Ping(1, peer.target))
        headers = peer.sign(CONTROL, data)[1]
        bad = bytearray(data)
        bad[-3] ^= 0x01  # inside the JSON: still a frame, but not the bytes the MAC covers
        return await peer.send(CONTROL, bytes(bad), headers)

    return [Case("no MAC headers", 401, "no MAC", no_mac),
            Case("wrong swarm key", 401, "wrong swarm key", wrong_key),
            Case("request under another member's id", 401, "say hello", posing),
            Case("hello under another member's id", 401, "not node", posing_hello),
            Case("replayed request", 401, "replay", replayed, send_once),
            Case("body altered after signing", 401, "does not verify", altered)]


def size_cases(peer: FakePeer) -> list[Case]:
    def declared(route: str, limit: int) -> Callable[[], Awaitable[Answer]]:
        # 1 KiB of a body that claims to be far larger: answered without waiting for the rest
        return lambda: raw_http(peer.addr, post_head(
            peer.addr, route, f"Content-Length: {limit + (8 << 20)}") + b"\0" * 1024)

    def chunked() -> Awaitable[Answer]:
        data = b"\0" * (CONTROL_LIMIT + 1)
        # well-formed (unverifiable) credentials: the server reads up to the limit, then 413
        assert peer.receiver is not None
        creds = (f"X-P2P-Version: {PROTOCOL_VERSION}\r\nX-P2P-To: {peer.receiver.header()}\r\n"
                 f"X-P2P-Sender: {peer.node_id}\r\nX-P2P-Seq: 1.{peer.signer.seq + 1000}\r\n"
                 f"X-P2P-MAC: {'0' * 64}")
        return raw_http(peer.addr, post_head(peer.addr, CONTROL, "Transfer-Encoding: chunked\r\n"
                                             + creds)
                        + f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n\r\n")

    return [Case("Content-Length above the gossip limit", 413, "exceeds",
                 declared(GOSSIP, GOSSIP_LIMIT)),
            Case("Content-Length above the control limit", 413, "exceeds",
                 declared(CONTROL, CONTROL_LIMIT)),
            Case("chunked body above the control limit", 413, "exceeds", chunked)]


def frame_cases(peer: FakePeer, n: int) -> list[Case]:
    def push(**header: Any) -> bytes:
        chunk = gradient_chunk(peer.node_id, np.full(n, 1e-3, np.float32), samples=77)
        return peer.frame(GradientPush(1, 1.0, chunk), **header)

    def well_framed(text: bytes, n_json: int | None = None) -> bytes:
        size = len(text) if n_json is None else n_json
        return struct.pack("<4sBBHII", wire.MAGIC, 1, 32, 0, size, 0) + text

    stranger = random_id()
    return [
        Case("truncated frame", 400, "frame declares", lambda: peer.post(
            GOSSIP, push(**peer.poison())[:-10])),
        Case("garbage bytes", 400, "does not carry", lambda: peer.post(
            GOSSIP, secrets.token_bytes(300).replace(b"P2PM", b"xxxx"))),
        Case("garbage JSON in a frame", 400, "GradientPush", lambda: peer.post(
            GOSSIP, well_framed(b'[{"not": json'))),
        Case("frame declaring 4 GB", 400, "exceed", lambda: peer.post(
            GOSSIP, well_framed(b"[]", 2**32 - 1))),
        Case("Ping on /v1/gossip", 400, "does not carry", lambda: peer.post(
            GOSSIP, peer.frame(Ping(1, peer.target), **peer.poison()))),
        Case("GradientPush on /v1/control", 400, "does not carry", lambda: peer.post(
            CONTROL, push(**peer.poison()))),
        Case("header.sender is not the authenticated sender", 400, "sender differs",
             lambda: peer.post(GOSSIP, push(sender=stranger, **peer.poison()))),
    ]


def gossip_cases(peer: FakePeer, n: int) -> list[Case]:
    """Gradient pushes from a member (the first from a non-member) whose bodies are bad."""
    ones = np.full(n, 1e-3, np.float32)
    nan = np.float32("nan").tobytes()

    def push(chunk: bytes, signer: Signer | None = None, **header: Any) -> Callable:
        return lambda: peer.post(GOSSIP, peer.frame(GradientPush(1, 1.0, chunk),
                                                    **{**peer.poison(), **header}), signer)

    outsider_signer = Signer(derive_mac_key(peer.swarm.key), Life.throwaway(1))
    outsider = outsider_signer.node_id
    good = gradient_chunk(peer.node_id, ones, samples=101)
    with_nan = with_payload(gradient_chunk(peer.node_id, ones, samples=102), 4 * (n // 2), nan)
    return [
        Case("gradient from a non-member", 400, "not a member",
             push(gradient_chunk(outsider, ones, samples=100), outsider_signer, sender=outsider)),
        Case("gradient chunk holding NaN", 400, "non-finite",
             push(with_nan)),
        Case("gradient of another model size", 400, "elements",
             push(gradient_chunk(peer.node_id, np.full(n + 10, 1e-3, np.float32), samples=103))),
        Case("gradient chunk naming another sender", 400, "another sender",
             push(gradient_chunk(peer.ghost, ones, samples=104))),
        Case("gradient chunk with a bad checksum", 400, "checksum",
             push(with_payload(good, 0, b"\x01\x02\x03\x04", fix_checksum=False))),
        Case("gradient claiming 10^9 samples", 400, "weight",
             push(gradient_chunk(peer.node_id, ones, samples=105, weight=1e9))),
    ]


# -- part 1: an in-process node ---------------------------------------------------------------


async def until(what: str, check: Callable[[], Any], timeout: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (value := check()):
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.02)
    return value


@contextlib.asynccontextmanager
async def running_node(tmp_path: Path, swarm: Swarm) -> AsyncIterator[Runtime]:
    """A real networked node in this event loop, leading itself and held in its join phase
    (it waits for two peers; the fake peer is one), so it never steps."""
    cfg = resolve(None, {}, {
        "model.name": "mlp", "model.mlp.n_hidden": 32, "model.mlp.n_embd": 8,
        "model.mlp.ctx_len": 16, "train.batch": 8, "node.state_dir": str(tmp_path / "node"),
        "node.min_peers": 2, "node.join_timeout": 3600.0, "net.bind": "127.0.0.1",
        "net.port": 0, "net.mdns": False, "net.timing": "local", "eval.every_seconds": 0.0,
        "checkpoint.every_seconds": 0.0, "log.every_seconds": 60.0, "log.format": "json",
        "gossip.codec": "none",  # the swarm's codec: the fake peer's raw float32 chunks
        # these tests send many bad values under one member's id on purpose: no cool-off
        "node.offender_refusals": 0})
    with open(tmp_path / "node.log", "w") as log:
        rt = Runtime(settings_of(cfg), swarm_options(cfg), Reporter("json", out=log, err=log),
                     swarm)
        task = asyncio.create_task(rt.run())
        try:
            await until("the node to listen", lambda: task.done() or (
                rt.node is not None and rt.phase == "running"), 60)
            if task.done():
                task.result()  # raises what stopped it
            # leading (a lone node claims after one lease): the election is settled before
            # the first request, so any later change of term or leader came from a request
            await until("the node to lead itself", lambda: rt.node.is_leader, 30)
            yield rt
        finally:
            rt.request_stop("test over")
            code = await asyncio.wait_for(task, 30)
    assert code == 0


def observe(rt: Runtime, peer_id: str) -> dict[str, Any]:
    """What a refused request must leave as it was (besides the parameters)."""
    node = rt.node
    ctl, trainer = node.control, node.trainer
    m = ctl.membership.table.members.get(peer_id)
    return {
        "members": {i: (state, inc) for i, (state, inc, _) in ctl.members().items()},
        "peer": None if m is None else (m.state, m.incarnation, m.beat, m.heard_at),
        "samples": ctl.sample_counts(),
        "election": (ctl.term, ctl.leader, ctl.is_leader),
        "pull_from": ctl.membership.pull_from,
        "mixer": (trainer.mixer.pending, trainer.mixer.pending_bytes),
        "gossip": dict(trainer.stats),
        "peer_progress": dict(trainer.peer_progress),
        "learner": (rt.learner.step, rt.learner.count.as_dict()),
        "bytes_in": dict(node.bytes_in),
        "phase": node.phase,
    }


async def send_case(case: Case, seen: list[tuple[str, int, str]]) -> Answer:
    """Send one bad request and check the refusal's status and reason."""
    answer = await case.send()
    seen.append((case.name, answer.status, answer.reason))
    assert answer.status == case.status, (case.name, answer.status, answer.body[:300])
    assert case.reason.lower() in answer.reason.lower(), (case.name, answer.reason)
    return answer


async def expect_refused(rt: Runtime, peer: FakePeer, case: Case,
                         seen: list[tuple[str, int, str]]) -> None:
    await peer.ping()  # fresh liveness, and proof that the node still answers
    if case.prepare is not None:
        await case.prepare()
    before, params = observe(rt, peer.node_id), rt.learner.params.copy()
    await send_case(case, seen)
    assert observe(rt, peer.node_id) == before, case.name
    assert rt.learner.params.tobytes() == params.tobytes(), f"{case.name}: parameters changed"


def print_seen(title: str, seen: list[tuple[str, int, str]]) -> None:
    print(f"\n{title}")
    for name, status, reason in seen:
        print(f"  {status}  {name:<48} {reason[:90]}")


async def _in_process_node(tmp_path: Path) -> None:
    swarm = new_swarm("security")
    seen: list[tuple[str, int, str]] = []
    async with running_node(tmp_path, swarm) as rt, aiohttp.ClientSession() as session:
        n = int(rt.learner.params.shape[0])
        peer = FakePeer(session, rt.me.addr, swarm)
        seen.append(("member list of another configuration", 409, await peer.join()))
        assert peer.fingerprint == rt.me.fingerprint and peer.target == rt.node_id
        assert rt.node.control.member_state(peer.node_id) == "alive"
        assert rt.node.phase == "joining"  # one peer of the two it waits for: no step runs
        initial = rt.learner.params.copy()
        stats0 = dict(rt.stats)

        auth, size = auth_cases(peer), size_cases(peer)
        bad_input = frame_cases(peer, n) + gossip_cases(peer, n)
        for case in auth + size + bad_input:
            await expect_refused(rt, peer, case, seen)
        for route in ("/v1/config", "/v1/checkpoint"):  # MAC GET routes
            async with session.get(f"http://{rt.me.addr}{route}") as resp:
                seen.append((f"GET {route} without MAC", resp.status, ""))
                assert resp.status == 401
        assert rt.node.control.member(peer.ghost) is None
        refused = rt.stats.get("refused_auth", 0) - stats0.get("refused_auth", 0)
        assert refused == len(auth) + 2  # the two GETs count too
        assert (rt.stats.get("refused_bad_input", 0) - stats0.get("refused_bad_input", 0)
                == len(bad_input))

        # the control experiment: the same kind of message, well formed, is taken (queued
        # for the next step, which does not come: the parameters still do not move)
        good = gradient_chunk(peer.node_id, np.full(n, 1e-3, np.float32), samples=200)
        answer = await peer.post(GOSSIP, peer.frame(GradientPush(3, 2.5, good)))
        seen.append(("valid GradientPush", answer.status, answer.reason))
        assert answer.status == 200, answer.reason
        trainer = rt.node.trainer
        assert trainer.mixer.pending == 1 and trainer.stats["gradient_complete"] == 1
        assert trainer.peer_progress[peer.node_id] == (3, 2.5)
        await peer.ping()
        assert rt.learner.params.tobytes() == initial.tobytes()
        assert rt.learner.step == 0
    print_seen("in-process node:", seen)


def test_bad_requests_to_an_in_process_node_are_refused_and_change_nothing(tmp_path):
    asyncio.run(_in_process_node(tmp_path))


async def _refused_by_the_mixer(tmp_path: Path) -> None:
    swarm = new_swarm("security")
    seen: list[tuple[str, int, str]] = []
    async with running_node(tmp_path, swarm) as rt, aiohttp.ClientSession() as session:
        n = int(rt.learner.params.shape[0])
        peer = FakePeer(session, rt.me.addr, swarm)
        await peer.join()
        good = gradient_chunk(peer.node_id, np.full(n, 1e-3, np.float32), samples=300)
        answer = await peer.post(GOSSIP, peer.frame(GradientPush(1, 1.0, good)))
        assert answer.status == 200, answer.reason
        huge = gradient_chunk(peer.node_id, np.full(n, 1e7, np.float32), samples=301)
        cases: list[Case] = [
            Case("gradient of absurd norm (finite values)", 400, "absurd", lambda: peer.post(
                GOSSIP, peer.frame(GradientPush(2, 1.0, huge), **peer.poison()))),
            Case("the same gradient chunk again", 400, "duplicate", lambda: peer.post(
                GOSSIP, peer.frame(GradientPush(1, 1.0, good), **peer.poison()))),
        ]
        try:
            for case in cases:
                await expect_refused(rt, peer, case, seen)
        finally:
            print_seen("refused by the gradient mixer:", seen)


def test_a_gradient_the_mixer_refuses_changes_nothing(tmp_path):
    asyncio.run(_refused_by_the_mixer(tmp_path))


# -- part 2: a training process under a burst of bad requests ---------------------------------


async def _burst(addr: str, swarm: Swarm, n: int, victim: str) -> tuple[int, int, list]:
    seen: list[tuple[str, int, str]] = []
    async with aiohttp.ClientSession() as session:
        peer = FakePeer(session, addr, swarm, victim)
        await peer.join()
        cases = (auth_cases(peer) + size_cases(peer) + frame_cases(peer, n)
                 + gossip_cases(peer, n))
        for round_ in range(3):
            for case in cases:
                if case.prepare is not None:
                    await case.prepare()
                    await send_case(case, seen)
            if round_ == 1:  # all at once
                await asyncio.gather(*(send_case(c, seen) for c in cases if c.prepare is None))
            else:
                for case in cases:
                    if case.prepare is None:
                        await send_case(case, seen)
            await peer.ping()
    return (sum(status == 401 for _, status, _ in seen),
            sum(status == 400 for _, status, _ in seen), seen)


def test_a_training_node_shrugs_off_a_burst_of_bad_requests(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(2)
        calm = lab.env(P2PTRAIN_NODE_OFFENDER_REFUSALS="0",  # the burst forges member ids
                       P2PTRAIN_GOSSIP_CODEC="none")  # and its chunks are raw float32
        first = lab.start("n0", ports[0], [], env=calm)
        second = lab.start("n1", ports[1], [first.addr], env=calm)
        wait_for("both nodes to train", lambda: all(
            p.status()["step"] >= 5 for p in (first, second)), 45)
        cfg = resolve(str(lab.config), {}, {})
        n = build_model(cfg["model.name"], cfg.model_config()).space.n_params
        before = first.status()["runtime"]
        second_id = second.status()["node_id"]  # the burst also poses as it
        n_auth, n_bad, seen = asyncio.run(_burst(first.addr, lab.swarm, n, second_id))
        step, refused = first.status()["step"], first.status()["runtime"].get("refused_auth", 0)
        doc = wait_for("the node to keep stepping", lambda: (
            lambda d: d["step"] >= step + 10 and d)(first.status()), 30)
        # the other node's own requests, many since, were all taken: none refused
        assert doc["runtime"].get("refused_auth", 0) == refused
        print_seen(f"burst against a training node (step {step} -> {doc['step']}):", seen[:20])
        after = doc["runtime"]
        for key, sent in (("refused_auth", n_auth), ("refused_bad_input", n_bad)):
            assert after.get(key, 0) - before.get(key, 0) >= sent, (key, before, after)
        assert np.isfinite(doc["loss"])
        wait_for("the other node alive in its view", lambda: second_id in {
            m["node_id"] for m in first.status()["members"] if m["state"] == "alive"}, 30)
        assert lab.stop_all() == [0, 0]


# -- part 3: checkpoints from a live leader ---------------------------------------------------


async def _fetch(addr: str, swarm: Swarm, out: Path, expected: str) -> Path:
    signer = Signer(derive_mac_key(swarm.key), Life.throwaway(0))
    async with aiohttp.ClientSession() as session:
        return await fetch_latest(session, f"http://{addr}", signer, out,
                                  expected_leader=expected, chunk_retries=2, timeout=10)


def _no_checkpoint_in(out: Path) -> bool:
    return not out.exists() or not any(is_checkpoint_name(p.name) for p in out.iterdir())


def test_the_fetcher_refuses_corrupt_or_foreign_checkpoints(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(2)
        # the leader writes one checkpoint (when it claims) and no periodic ones, so the
        # corrupted checkpoint below stays the newest it serves
        lead = lab.start("lead", ports[0], [], "--priority", "10",
                         env=lab.env(P2PTRAIN_CHECKPOINT_EVERY_SECONDS="0"))
        leader = wait_for("the first node to lead", lambda: (
            lambda d: d["is_leader"] and d["node_id"])(lead.status()), 30)
        follower = lab.start("follow", ports[1], [lead.addr])
        follower_id = wait_for("the second node to follow", lambda: (
            lambda d: d["leader"] == leader and d["node_id"])(follower.status()), 30)
        ours = wait_for("a checkpoint signed by the leader", lambda: [
            c for c in checkpoint.list_checkpoints(lead.state_dir / "checkpoints")
            if checkpoint.read_manifest(c).leader == leader], 30)
        wait_for("a local checkpoint of the follower, signed by itself", lambda: [
            c for c in checkpoint.list_checkpoints(follower.state_dir / "checkpoints")
            if checkpoint.read_manifest(c).leader == follower_id], 30)

        # (b) manifests signed by a non-leader
        for addr, expected, signer_id in ((follower.addr, leader, follower_id),
                                          (lead.addr, follower_id, leader)):
            out = tmp_path / f"out-{signer_id[:8]}"
            with pytest.raises(FetchError) as err:
                asyncio.run(_fetch(addr, lab.swarm, out, expected))
            print(f"\nexpected leader {expected[:8]}, served by {signer_id[:8]}: {err.value}")
            assert f"signed by {signer_id}, not the leader {expected}" in str(err.value)
            assert _no_checkpoint_in(out)

        # the control experiment: the leader's checkpoint, untouched, is fetched
        got = asyncio.run(_fetch(lead.addr, lab.swarm, tmp_path / "out-good", leader))
        assert checkpoint.read_manifest(got).leader == leader

        # (a) one byte flipped in the leader's weights after the manifest was written
        target = ours[0] / checkpoint.MODEL_FILE
        data = bytearray(target.read_bytes())
        data[-1] ^= 0xFF
        target.chmod(0o644)
        target.write_bytes(bytes(data))
        out = tmp_path / "out-corrupt"
        with pytest.raises(FetchError) as err:
            asyncio.run(_fetch(lead.addr, lab.swarm, out, leader))
        print(f"corrupted weights, fetch_latest: {err.value}; left in the output dir: "
              f"{sorted(p.name for p in out.iterdir()) if out.exists() else []}")
        assert _no_checkpoint_in(out)
        cli_out = tmp_path / "out-cli"
        r = run_cli("checkpoint", "fetch", "--peer", lead.addr, "--out", str(cli_out),
                    "--token", lab.swarm.token(), env=lab.env(), timeout=60)
        print(f"corrupted weights, p2ptrain checkpoint fetch: exit {r.returncode}: "
              f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}")
        assert r.returncode != 0
        assert "checkpoint fetch failed" in r.stderr
        assert _no_checkpoint_in(cli_out)
        assert lead.alive() and follower.alive()
