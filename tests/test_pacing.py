"""The upload cap's control lane: a heartbeat-sized message never queues behind bulk bytes.

A real outbox posts to a real node server (aiohttp on 127.0.0.1, port 0) whose host only
records when each message arrives. Two gradient pushes of 1.5 MiB go out through an upload
cap of 8 Mbit/s (about 3 s of pacing); meanwhile heartbeats are sent every 0.1 s. The
figure is a ratio: the worst heartbeat's delay (send -> delivered to the node) against the
time the bulk bodies took, so the test does not depend on how fast this machine is. The
outbox's count of what it sent by kind (`sent_by_kind`) is checked against the frames' sizes.
And a gradient push of several chunks goes whole or not at all.
"""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import numpy as np
from aiohttp import web

from p2ptrain.codecs import encode_vector, make_codec
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.outbox import Outbox
from p2ptrain.net.pacing import TokenBucket, paced
from p2ptrain.net.server import Served, build_app, listen
from p2ptrain.net.session import Life
from p2ptrain.proto import Send, wire
from p2ptrain.proto.gossip.messages import GradientPush
from p2ptrain.proto.messages import PROTOCOL_VERSION, Envelope, Header, Heartbeat
from p2ptrain.proto.node import NodeConfig
from p2ptrain.report import Reporter

KEY = derive_mac_key(bytes(range(32)))
LIFE_S, LIFE_R = Life.throwaway(1), Life.throwaway(1)  # sender, receiver
SENDER, RECEIVER = LIFE_S.node_id, LIFE_R.node_id
BULK_BYTES = 3 << 19  # 1.5 MiB per gradient push
CAP_MBPS = 8.0


class RecordingHost:
    """The server's host: records (body type, tag, arrival time) of every message."""

    def __init__(self) -> None:
        self.node_id = RECEIVER
        self.arrivals: list[tuple[str, int, float]] = []
        self.counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def deliver(self, envelope, remote, sender, size):
        now = asyncio.get_running_loop().time()
        self.arrivals.append((type(envelope.body).__name__, envelope.header.beat, now))
        return 200, [], ""

    def status(self) -> dict:
        return {"node_id": self.node_id}

    def health(self) -> dict:
        return {"ok": True}

    def swarm_config(self) -> dict:
        return {"swarm": "test", "options": {}}


def envelope(beat: int, body) -> Envelope:
    return Envelope(Header(PROTOCOL_VERSION, SENDER, 1, "127.0.0.1:9", "0" * 16, 0, beat, 2,
                           None, ()), body)


def push(beat: int) -> Envelope:
    values = np.full(BULK_BYTES // 4, 1e-3, np.float32)
    (chunk,) = encode_vector(make_codec("none"), values, sender_id=bytes.fromhex(SENDER),
                             swarm_samples=beat, weight=8.0, seed=1)
    return envelope(beat, GradientPush(beat, 1.0, bytes(chunk)))


async def until(what: str, check, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.01)


async def scenario(tmp: Path) -> tuple[float, float, list[float]]:
    host = RecordingHost()
    served = Served(host, ServerAuth(KEY, LIFE_R), TokenBucket(0), True)
    runner = web.AppRunner(build_app(served, lambda: tmp), access_log=None)
    await runner.setup()
    port = await listen(runner, "127.0.0.1", 0)
    addr = f"127.0.0.1:{port}"
    bucket = TokenBucket.mbps(CAP_MBPS)
    outbox = Outbox.open(Signer(KEY, LIFE_S), bucket, lambda a, f: None,
                         Reporter("json", out=io.StringIO(), err=io.StringIO()), NodeConfig())
    loop = asyncio.get_running_loop()
    sent: dict[int, float] = {}
    try:
        # warm-up: connections opened (and the receiver learnt) before anything is measured
        outbox.send(Send(RECEIVER, addr, envelope(1, Heartbeat())))
        outbox.send(Send(RECEIVER, addr, push(2)))
        await until("the warm-up", lambda: len(host.arrivals) == 2, 30)
        host.arrivals.clear()
        bulk_start = loop.time()
        for beat in (10, 11):
            outbox.send(Send(RECEIVER, addr, push(beat)))
        beat = 100
        while sum(kind == "GradientPush" for kind, _, _ in host.arrivals) < 2:
            assert loop.time() - bulk_start < 60, (host.arrivals, outbox.stats)
            sent[beat] = loop.time()
            outbox.send(Send(RECEIVER, addr, envelope(beat, Heartbeat())))
            beat += 1
            await asyncio.sleep(0.1)
        bulk_time = max(t for kind, _, t in host.arrivals if kind == "GradientPush") - bulk_start
        await until("the last heartbeat", lambda: sum(
            kind == "Heartbeat" for kind, _, _ in host.arrivals) == len(sent), 30)
        delays = [t - sent[tag] for kind, tag, t in host.arrivals if kind == "Heartbeat"]

        def counted(kind: str) -> int:  # the outbox counts a body once its response is back
            return outbox.sent.document().get(kind, {}).get("messages", 0)

        await until("the outbox's count of the last responses", lambda: (
            counted("GradientPush"), counted("Heartbeat")) == (3, 1 + len(sent)), 30)
        assert outbox.stats.get("failed", 0) == 0, (outbox.stats, outbox.last_error)
        pushes = [push(beat) for beat in (2, 10, 11)]  # every body went over HTTP: counted
        assert outbox.sent.document() == {  # exactly, whole frames and their chunk tails
            "GradientPush": {"messages": 3, "bytes": sum(len(wire.encode(e)) for e in pushes),
                             "chunk_bytes": sum(len(e.body.chunk) for e in pushes)},
            "Heartbeat": {"messages": 1 + len(sent), "chunk_bytes": 0, "bytes": sum(
                len(wire.encode(envelope(b, Heartbeat()))) for b in (1, *sent))}}
        return bulk_time, max(delays), delays
    finally:
        await outbox.close()
        await runner.cleanup()


def test_a_heartbeat_does_not_queue_behind_paced_bulk_bytes(tmp_path):
    bulk_time, worst, delays = asyncio.run(scenario(tmp_path))
    ideal = 2 * BULK_BYTES / (CAP_MBPS * 1e6 / 8)
    print(f"\nbulk: 2 x {BULK_BYTES >> 10} KiB at {CAP_MBPS:g} Mbit/s in {bulk_time:.2f}s "
          f"(ideal {ideal:.2f}s); {len(delays)} heartbeats, delay median "
          f"{sorted(delays)[len(delays) // 2] * 1e3:.1f} ms, worst {worst * 1e3:.1f} ms; "
          f"worst / bulk time = {worst / bulk_time:.4f}")
    assert bulk_time > 0.8 * ideal  # the bulk bodies really were paced
    assert worst / bulk_time < 0.02


async def _shared_cap() -> tuple[float, float]:
    bucket = TokenBucket(1e6)  # 1 MB/s, burst 300 kB
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def bulk() -> None:
        async for _ in paced(bytes(600_000), bucket):
            pass

    async def control() -> None:
        for _ in range(100):  # 400 kB of control bodies, 4 kB each
            await bucket.take(4000, control=True)

    await asyncio.gather(bulk(), control())
    return loop.time() - start, bucket.sent


def test_control_bytes_count_against_the_cap():
    """1 MB through a 1 MB/s bucket (300 kB burst) takes about 0.7 s whichever lane it uses."""
    elapsed, sent = asyncio.run(_shared_cap())
    assert sent == 1_000_000
    assert elapsed > 0.6, elapsed


async def two_vectors(tmp: Path) -> tuple[list[tuple[str, int, float]], dict]:
    """A push of 4 chunks (one Send each, as the trainer emits them), and at once another:
    the first goes whole, the second is dropped whole (the peer is busy with the first)."""
    host = RecordingHost()
    served = Served(host, ServerAuth(KEY, LIFE_R), TokenBucket(0), True)
    runner = web.AppRunner(build_app(served, lambda: tmp), access_log=None)
    await runner.setup()
    addr = f"127.0.0.1:{await listen(runner, '127.0.0.1', 0)}"
    outbox = Outbox.open(Signer(KEY, LIFE_S), TokenBucket(0), lambda a, f: None,
                         Reporter("json", out=io.StringIO(), err=io.StringIO()), NodeConfig())
    values = np.full(4 * 1024, 1e-3, np.float32)
    try:
        for step in (20, 21):
            chunks = encode_vector(make_codec("none"), values, sender_id=bytes.fromhex(SENDER),
                                   swarm_samples=step, weight=8.0, seed=1, chunk_elems=1024)
            for i, chunk in enumerate(chunks):
                outbox.send(Send(RECEIVER, addr, envelope(100 * step + i, GradientPush(
                    step, 1.0, bytes(chunk)))))
        await until("the first push's chunks", lambda: len(host.arrivals) >= 4, 30)
        await until("every post to end", lambda: not outbox.in_flight[addr], 30)
        return host.arrivals, dict(outbox.stats)
    finally:
        await outbox.close()
        await runner.cleanup()


def test_a_push_of_several_chunks_goes_whole_or_not_at_all(tmp_path):
    arrivals, stats = asyncio.run(two_vectors(tmp_path))
    assert sorted(tag for _, tag, _ in arrivals) == [2000, 2001, 2002, 2003], (arrivals, stats)
    assert stats["gradients_dropped_busy_peer"] == 1 and not stats.get("failed"), stats
