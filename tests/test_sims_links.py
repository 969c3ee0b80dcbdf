"""Link arithmetic with hand-computed expectations: FIFO queueing on one resource,
cut-through across hops, the shared WiFi airtime (station to station crosses the air twice),
Starlink's asymmetric rates and latency, NAT, loss bursts, partitions and the in-flight
limit."""

from __future__ import annotations

import dataclasses
import random

import pytest

from sims.engine import Engine
from sims.links import Hop, Resource, constant, transmit
from sims.network import CONTROL_BYTES, CONTROL_WAIT, FIBRE, STARLINK, Network, Site, Uplink

MB = 1_000_000


def _deliveries(engine, path, sizes):
    got = []
    for k, size in enumerate(sizes):
        transmit(engine, path, size, random.Random(0), lambda t, k=k: got.append((k, t.delivered)))
    engine.run_until(100.0)
    return [t for _, t in sorted(got)]


def test_fifo_queueing_on_one_resource():
    engine = Engine()
    link = Resource("link", rate=1e6)
    times = _deliveries(engine, [Hop(link, latency=constant(0.01))], [MB, MB])
    assert times == pytest.approx([1.01, 2.01])  # the second waits for the first
    assert link.utilisation(4.0) == pytest.approx(0.5)
    assert link.utilisation(1.5) == pytest.approx(1.0)  # work booked past 1.5 s excluded


def test_a_control_message_waits_at_most_its_cap_for_the_bulk_ahead():
    """A small message given a wait cap goes between a bulk message's packets: it waits at
    most the cap (not the whole 1 MB ahead of it), and the bulk's end moves by its work."""
    engine = Engine()
    link = Resource("link", rate=1e6)
    got = {}
    transmit(engine, [Hop(link)], MB, random.Random(0), lambda t: got.setdefault("bulk", t))
    transmit(engine, [Hop(link)], 1000, random.Random(0), lambda t: got.setdefault("ctl", t),
             wait_cap=0.05)
    transmit(engine, [Hop(link)], 1000, random.Random(0), lambda t: got.setdefault("fifo", t))
    engine.run_until(10.0)
    assert got["ctl"].delivered == pytest.approx(0.05 + 0.001)
    assert got["fifo"].delivered == pytest.approx(1.0 + 0.001 + 0.001)  # behind both
    assert link.busy_until == pytest.approx(1.002) and link.utilisation(2.0) == pytest.approx(
        1.002 / 2.0)


def test_the_network_sends_small_control_messages_between_bulk_packets():
    """Through the shared air, a heartbeat sent after a 10 MB exchange arrives within the
    control wait at each of its two hops (the air, the receiver's NIC); a message that is
    not bulk but large (1 MB) still queues behind the exchange."""
    engine, net = _lab()
    times = {}
    net.send(0, 2, 10 * MB, lambda: times.setdefault("bulk", engine.now), bulk=True)
    net.send(1, 2, 200, lambda: times.setdefault("heartbeat", engine.now))
    net.send(1, 2, MB, lambda: times.setdefault("large", engine.now))
    engine.run_until(100.0)
    assert times["heartbeat"] < 2 * CONTROL_WAIT + 0.01 < 1.0 < times["bulk"] < times["large"]
    assert CONTROL_BYTES >= 1 << 10


def test_cut_through_does_not_pay_each_hop_in_full():
    for rates in ((1e6, 1e6), (1e6, 4e6), (4e6, 1e6)):
        engine = Engine()
        a, b = Resource("a", rates[0]), Resource("b", rates[1])
        path = [Hop(a, latency=constant(0.01)), Hop(b, latency=constant(0.01))]
        # the slowest hop sets the pace: 1 MB at 1 MB/s plus both latencies
        assert _deliveries(engine, path, [MB]) == pytest.approx([1.02])
        assert b.busy_time == pytest.approx(MB / rates[1])  # booked for its own work only


def test_queue_limit_and_loss_drop_messages():
    engine = Engine()
    link = Resource("link", 1e6)
    lost = []
    path = [Hop(link, queue_limit=1.5)]
    for _ in range(3):  # backlogs 0, 1, 2 s: the third is over the limit
        transmit(engine, path, MB, random.Random(0), lambda t: None, lost.append)
    assert [t.dropped_at for t in lost] == ["link"] and link.dropped == 1
    always = [Hop(Resource("lossy", 1e6), loss=lambda s, e, rng: True)]
    transmit(engine, always, 10, random.Random(0), lambda t: None, lost.append)
    assert len(lost) == 2


QUIET_STARLINK = dataclasses.replace(STARLINK, jitter_ms=0.0, loss=0.0, burst_loss=0.0,
                                     reconfig_period=0.0)


def _lab(uplink: Uplink = QUIET_STARLINK):
    engine = Engine()
    net = Network(engine, [Site("a", dataclasses.replace(FIBRE, jitter_ms=0.0)),
                           Site("b", uplink)])
    net.attach(0, "a", "wifi", 10e6)
    net.attach(1, "a", "wifi", 5e6)
    net.attach(2, "a", "wired", 125e6)
    net.attach(3, "b", "wifi", 10e6)
    return engine, net


def _send(engine, net, pairs, size, **kw):
    got = {}
    for src, dst in pairs:
        assert net.send(src, dst, size, lambda s=src, d=dst: got.__setitem__((s, d), engine.now),
                        **kw)
    engine.run_until(100.0)
    return got


def test_stations_share_the_airtime():
    engine, net = _lab()
    got = _send(engine, net, [(0, 2), (1, 2)], MB)
    # station 0: air [0, 0.1] at its 10 MB/s; wired rx cannot finish before the air has passed
    # the last byte: 0.1 + 2 ms air latency, + 0.1 ms wired latency.
    # station 1 waits for the air: [0.1, 0.3] at its 5 MB/s -> 0.3 + 0.002 + 0.0001.
    assert got[(0, 2)] == pytest.approx(0.1021)
    assert got[(1, 2)] == pytest.approx(0.3021)
    assert net.air["a"].utilisation(0.3) == pytest.approx(1.0)


def test_station_to_station_crosses_the_air_twice():
    engine, net = _lab()
    got = _send(engine, net, [(0, 1)], MB)
    # up at the sender's 10 MB/s [0, 0.1], down at the receiver's 5 MB/s [0.1, 0.3], +2 ms
    assert got[(0, 1)] == pytest.approx(0.302)
    assert net.air["a"].busy_time == pytest.approx(0.3)


def test_starlink_is_asymmetric_and_natted():
    engine, net = _lab()
    up = _send(engine, net, [(3, 2)], 1_500_000)
    # farm air 0.15 s; Starlink up 15 Mbit/s = 1.875 MB/s: 0.8 s, from 2 ms on -> 0.802;
    # + 25 ms; fibre down and the server's NIC pass it on: +2 ms, +0.1 ms
    assert up[(3, 2)] == pytest.approx(0.8291)
    assert not net.send(2, 3, 1000, lambda: None)  # a request into the NATed site: refused
    engine, net = _lab()
    down = _send(engine, net, [(2, 3)], 1_500_000, reply=True)  # a reply passes NAT
    # NIC 12 ms, fibre up, +2 ms; Starlink down 100 Mbit/s: 0.12 s from 2.1 ms -> 0.1221;
    # + 25 ms; farm air at 10 MB/s: 0.15 s from 27.1 ms -> 0.1771; + 2 ms
    assert down[(2, 3)] == pytest.approx(0.1791)
    assert net.reachable(3, 2) and net.reachable(3, 3) is True


def test_reconfiguration_bursts():
    link = STARLINK  # every 15 s from 12 s, 0.5 s long
    assert link.in_burst(12.2, 12.3) and link.in_burst(11.9, 12.1)
    assert link.in_burst(26.0, 27.1) and link.in_burst(40.0, 60.0)
    assert not link.in_burst(13.0, 14.0) and not link.in_burst(0.0, 11.0)
    rng = random.Random(1)
    lossy = dataclasses.replace(STARLINK, loss=0.0, burst_loss=1.0)
    assert lossy.lost(12.0, 12.1, rng) and not lossy.lost(13.0, 13.1, rng)
    assert lossy.latency(12.1, rng) > 0.1 > lossy.latency(13.0, rng)


def test_partitions_and_the_in_flight_limit():
    engine, net = _lab()
    net.partition([[0, 1]])
    assert not net.send(0, 2, 10, lambda: None) and net.send(0, 1, 10, lambda: None)
    net.heal()
    assert net.send(0, 2, 10, lambda: None)
    # two gradient pushes to one peer may be in flight; the third is dropped
    assert net.send(1, 2, MB, lambda: None, droppable=True)
    assert net.send(1, 2, MB, lambda: None, droppable=True)
    assert not net.send(1, 2, MB, lambda: None, droppable=True)
    engine.run_until(10.0)
    assert net.in_flight[(1, 2)] == 0 and net.send(1, 2, MB, lambda: None, droppable=True)
