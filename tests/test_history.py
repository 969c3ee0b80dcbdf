"""The dashboard's history (p2ptrain/net/history.py, pure: every time is an argument), the
reporter tap that feeds it events (net/watch.py), and GET /v1/history, open or behind the MAC
as `net.open_routes` says."""

from __future__ import annotations

import asyncio
import io
import threading

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.net.auth import Receiver, ServerAuth, Signer, derive_mac_key
from p2ptrain.net.history import QUIET_EVENTS, Events, History, Rates, Series, rate
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.server import Served, build_app, listen
from p2ptrain.net.session import Life
from p2ptrain.net.watch import Watch
from p2ptrain.report import Reporter
from tests.helpers import introduce


def status(step: int, bytes_in: int, upload: int, swarm: int, peers=()) -> dict:
    """A status document as the runtime serves it (only what the history reads)."""
    return {"node_id": "me", "step": step, "loss": 2.0 - step / 100, "eval_loss": None,
            "samples": 8 * step, "swarm_samples": swarm, "bytes_in": bytes_in,
            "bytes_out": upload, "upload_bytes": upload,
            "members": [{"node_id": p, "bytes_in": i, "bytes_out": o} for p, i, o in peers]}


def test_rate_between_two_readings():
    assert rate((0.0, 100), (2.0, 300)) == 100.0
    assert rate((0.0, 100), (0.0, 300)) is None  # no interval
    assert rate((0.0, 300), (1.0, 100)) is None  # a counter that started again
    assert rate((0.0, None), (1.0, 100)) is None


def test_a_series_keeps_its_spacing_and_thins_itself_when_full():
    series = Series(capacity=8, spacing=1.0)
    assert series.add(0.0, {"step": 0})
    assert not series.add(0.5, {"step": 1})  # sooner than the spacing
    for t in range(1, 8):
        assert series.add(float(t), {"step": t})
    assert len(series.points) == 8
    assert series.add(8.0, {"step": 8})  # full: every other point goes, the spacing doubles
    assert [p["t"] for p in series.points] == [0, 2, 4, 6, 8] and series.spacing == 2.0
    assert not series.add(9.0, {"step": 9})
    for t in range(10, 200):
        series.add(float(t), {"step": t})
        assert len(series.points) <= 8
    assert series.points[0]["t"] == 0 and series.points[-1]["t"] >= 199 - series.spacing
    with pytest.raises(ValueError):
        Series(capacity=2)


def test_rates_come_from_points_a_window_apart():
    series = Series(capacity=100)
    for t in range(12):  # 1000 B/s in, 2 samples/s, but the samples arrive in bursts of 10
        series.add(float(t), {"bytes_in": 1000 * t, "upload_bytes": 500 * t,
                              "swarm_samples": 10 * (t // 5)})
    points = series.with_rates(window=5.0)
    assert points[0]["in_per_s"] is None
    assert points[1]["in_per_s"] == 1000.0 and points[3]["out_per_s"] == 500.0
    assert points[3]["samples_per_s"] == 0.0  # t=0..3: the counter has not moved yet
    assert [p["samples_per_s"] for p in points[5:]] == [2.0] * 7  # over 5 s: smooth
    series.add(12.0, {"bytes_in": 10, "upload_bytes": 6000, "swarm_samples": 20})
    assert series.with_rates()[-1]["in_per_s"] is None  # the counter went back: no rate


def test_member_rates_over_the_window():
    rates = Rates(window=2.0)
    assert rates.current() == {}
    for t in range(6):
        rates.add(float(t), {"a": (100 * t, 10 * t), **({"b": (t, t)} if t >= 4 else {})})
    assert len(rates.readings) <= 4  # bounded by the window
    now = rates.current()
    assert now["a"] == {"in_per_s": 100.0, "out_per_s": 10.0}
    assert "b" not in now  # not in the oldest reading kept: no rate yet
    rates.add(6.0, {"b": (6, 6)})  # a gone, b on
    assert set(rates.current()) == {"b"}


def test_events_are_bounded_quiet_ones_skipped_and_repeats_counted():
    events = Events(capacity=3)
    events.add(1.0, "info", "member_up", "member a up")
    for quiet in QUIET_EVENTS:
        events.add(1.5, "info", quiet, "step 5")
    events.add(2.0, "warning", "send_failed", "request failed")
    events.add(3.0, "warning", "send_failed", "request failed")
    rows = events.recent()
    assert [(r["event"], r["repeats"], r["t"]) for r in rows] == [
        ("member_up", 1, 1.0), ("send_failed", 2, 3.0)]
    for i in range(5):
        events.add(4.0 + i, "info", "checkpoint", f"checkpoint {i} written")
    assert [r["message"] for r in events.recent()] == [
        "checkpoint 2 written", "checkpoint 3 written", "checkpoint 4 written"]
    rows[0]["repeats"] = 99  # copies: the reader cannot change the list
    assert all(r["repeats"] == 1 for r in events.recent())


def test_the_history_document():
    history = History(capacity=50, window=2.0)
    history.sample(0.0, {"node_id": "me", "upload_bytes": 0, "members": []})  # not started
    for t in range(4):
        history.sample(float(t), status(10 * t, 1000 * t, 2000 * t, 80 * t,
                                        [("peer", 300 * t, 400 * t)]))
    history.note(3.5, "info", "leader", "leader is peer (term 1)")
    doc = history.document(4.0)
    assert doc["now"] == 4.0 and doc["spacing"] == 1.0
    assert [p["step"] for p in doc["points"]] == [0, 10, 20, 30]
    assert doc["points"][-1]["samples_per_s"] == 80.0
    assert doc["member_rates"] == {"me": {"in_per_s": 1000.0, "out_per_s": 2000.0},
                                   "peer": {"in_per_s": 300.0, "out_per_s": 400.0}}
    assert doc["events"] == [{"t": 3.5, "level": "info", "event": "leader",
                              "message": "leader is peer (term 1)", "repeats": 1}]


def test_the_watch_notes_what_the_reporter_says_until_closed():
    clock = iter(float(t) for t in range(100))
    reporter = Reporter("text", out=io.StringIO(), err=io.StringIO())
    watch = Watch(reporter, lambda: next(clock))
    reporter.info("member abc up", event="member_up")
    reporter.warn("disk full", event="checkpoint_failed")
    reporter.info("step 3 | loss 2.0", event="progress")
    worker = threading.Thread(target=reporter.info, args=("from a thread",),
                              kwargs={"event": "checkpoint"})
    worker.start()
    worker.join()
    watch.close()
    reporter.info("after close", event="member_up")
    rows = watch.history.events.recent()
    assert [(r["level"], r["event"], r["message"]) for r in rows] == [
        ("info", "member_up", "member abc up"),
        ("warning", "checkpoint_failed", "disk full"),  # without the text-mode prefix
        ("info", "checkpoint", "from a thread")]
    assert reporter.err.getvalue() == "warning: disk full\n"  # the output is unchanged


class Host:
    life = Life.throwaway(1)
    node_id = life.node_id

    def count(self, what: str, n: int = 1) -> None:
        pass

    def status(self) -> dict:
        return {"node_id": self.node_id}

    def health(self) -> dict:
        return {"ok": True}


KEY = derive_mac_key(bytes(range(32)))


async def fetch_history(open_routes: bool, history=None) -> list[tuple[int, dict]]:
    auth = ServerAuth(KEY, Host.life)
    served = Served(Host(), auth, TokenBucket(0), open_routes, history=history)
    runner = web.AppRunner(build_app(served, lambda: None), access_log=None)
    await runner.setup()
    try:
        port = await listen(runner, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/history"
        signer = Signer(KEY, Life.throwaway(1))
        introduce(signer, auth)
        out = []
        async with aiohttp.ClientSession() as session:
            _, signed = signer.sign_request("GET", "/v1/history", to=Receiver(Host.node_id, 1))
            for headers in ({}, signed):
                async with session.get(url, headers=headers) as resp:
                    out.append((resp.status, await resp.json()))
        return out
    finally:
        await runner.cleanup()


def test_the_history_route_is_open_unless_the_routes_are_closed():
    history = History()
    history.note(1.0, "info", "listening", "node up")
    doc = lambda: history.document(2.0)  # noqa: E731
    (plain, _), (signed, body) = asyncio.run(fetch_history(True, doc))
    assert plain == signed == 200 and body["events"][0]["message"] == "node up"
    (plain, _), (signed, body) = asyncio.run(fetch_history(False, doc))
    assert (plain, signed) == (401, 200) and body["now"] == 2.0
    (plain, _), _ = asyncio.run(fetch_history(True, None))
    assert plain == 404


def test_the_history_answer_is_built_at_most_once_a_second():
    """A full history is ~200 kB of JSON, 6.8 ms to build and compress on the node's loop;
    an address may ask 50 times a second (a third of the loop). It is built once a second."""
    import gzip
    import json

    from p2ptrain.net.dashboard import Built

    calls = []
    built = Built(lambda: calls.append(1) or {"n": len(calls)}, fresh=1.0)
    first = built.get(10.0)
    assert built.get(10.5) == first and len(calls) == 1
    plain, packed = built.get(11.0)
    assert len(calls) == 2 and json.loads(plain) == {"n": 2} == json.loads(gzip.decompress(packed))


@pytest.mark.parametrize("header,gzip", [
    ("gzip, deflate, br", True), ("br;q=1.0, gzip;q=0.8", True), ("gzip;q=0", False),
    ("identity", False), ("*", True), ("*;q=0", False), ("", False), ("gzip;q=x", False)])
def test_the_history_is_gzipped_only_for_a_client_that_takes_it(header, gzip):
    from p2ptrain.net.dashboard import accepts_gzip

    assert accepts_gzip(header) is gzip


def test_events_carry_no_absolute_paths():
    """GET /v1/history is open by default: a log line naming a file of the state directory
    (an OS error's, a fetched base's) said where the node keeps its files, and whose home
    it is, to anyone on the network. Paths are cut to their last part; routes stay."""
    clock = iter(float(t) for t in range(100))
    reporter = Reporter("text", out=io.StringIO(), err=io.StringIO())
    watch = Watch(reporter, lambda: next(clock))
    reporter.warn("checkpoint not written (timed): no space left on device: "
                  "'/home/ann/.local/state/p2ptrain/checkpoints/.tmp-step-5'",
                  event="checkpoint_failed")
    reporter.info("base made in /srv/p2p/bases/rwkv-1b/ from GET /v1/base", event="base")
    watch.close()
    messages = [r["message"] for r in watch.history.events.recent()]
    assert messages == ["checkpoint not written (timed): no space left on device: "
                        "'.../.tmp-step-5'", "base made in .../rwkv-1b from GET /v1/base"]
    assert "ann" in reporter.err.getvalue()  # the node's own output keeps them
