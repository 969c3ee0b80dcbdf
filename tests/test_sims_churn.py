"""Churn in the simulator: machines fail and return on their drawn schedule (and rejoin from
the latest checkpoint as a new incarnation), a killed leader is replaced, a killed
coordinator stops its baseline until it returns, and partitions cut the sites apart."""

from __future__ import annotations

import dataclasses

import pytest

from p2ptrain.proto import Unanswered
from p2ptrain.proto.messages import Notify
from sims.coordinator import CoordinatorSim
from sims.fleet import Training, World
from sims.gossip import CONNECT_BYTES, GossipSim
from sims.scenario import Churn, Partition, load


@pytest.fixture(scope="module")
def ci():
    return load("ci")


def _world(scenario):
    return World(scenario, scenario.seed, Training(scenario))


def test_machines_fail_and_return_on_their_schedule(ci):
    scenario = ci.replace(churn=Churn(failures=True, mttf_scale=1e-4, mttr_scale=2e-3),
                          duration=12.0)
    world = _world(scenario)
    spans = world.failures()
    # rpi4: mttf 6 h x 1e-4 = 2.16 s, mttr 600 s x 2e-3 = 1.2 s: several failures each
    victim, (fail, back) = next((i, s[0]) for i, s in spans.items() if s and s[0][1] < 10)
    assert spans == world.failures()  # drawn from the seed: the same every time
    sim = GossipSim(world, scenario.methods[0])
    seen = {}

    def probe(label):
        mach = sim.machines[victim]
        seen[label] = (mach.node is not None, mach.incarnation)

    world.engine.at(fail + 1e-6, probe, "after fail")
    world.engine.at(back - 1e-6, probe, "before back")
    world.engine.at(back + 3.0, probe, "after back")
    sim.run()
    assert seen["after fail"] == (False, 1)
    assert seen["before back"] == (False, 1)
    up, incarnation = seen["after back"]
    later = [f for f, _ in spans[victim] if back < f <= back + 3.0]
    assert up or later  # back (a new incarnation), unless it failed again meanwhile
    assert incarnation >= 2


def test_a_killed_leader_is_replaced_within_the_failover_bound(ci):
    scenario = ci.replace(churn=Churn(leader_kill=6.0, leader_return=None), duration=14.0)
    world = _world(scenario)
    sim = GossipSim(world, scenario.methods[0])
    leaders = {}
    proto = sim.proto

    def who(label):
        leaders[label] = sorted(m.member.index for m in sim.machines
                                if m.node is not None and m.node.is_leader)

    world.engine.at(5.9, who, "before")
    bound = 6.0 + proto.failover_bound(len(world.members)) + proto.probe_interval
    world.engine.at(bound, who, "after")
    result = sim.run()
    killed = result["leader_killed"]
    assert killed["at"] == 6.0 and leaders["before"] == [killed["index"]]
    assert leaders["after"] and killed["index"] not in leaders["after"]
    assert sim.machines[killed["index"]].node is None  # never returned


def test_a_killed_coordinator_stops_training_until_it_returns(ci):
    scenario = ci.replace(churn=Churn(leader_kill=2.0, leader_return=5.0), duration=12.0,
                          train={**ci.train, "total_samples": 10**7})
    world = _world(scenario)
    sim = CoordinatorSim(world, scenario.methods[1])
    applied = {}
    for t in (2.5, 6.9, 7.001, 9.0):
        world.engine.at(t, lambda t=t: applied.__setitem__(t, sim.samples))
    result = sim.run()
    assert result["coordinator_deaths"] == [2.0]
    assert applied[6.9] == applied[2.5] > 0  # nothing applied while it is down
    # back at 7.0 from its last checkpoint -- the one at 0 s (the next was due at 5 s, after
    # the kill) -- so its progress restarts from there, then grows again
    assert applied[7.001] == 0 and applied[9.0] > 0
    assert result["retries"] > 0


def test_a_partition_cuts_the_sites_apart_and_heals(ci):
    scenario = ci.replace(churn=Churn(partitions=(Partition(3.0, 6.0, (("lab",), ("farm",))),)),
                          duration=8.0)
    world = _world(scenario)
    sim = GossipSim(world, scenario.methods[0])
    farm = [m.index for m in world.members if m.site == "farm"]
    lab = [m.index for m in world.members if m.site == "lab"]
    received = {}

    def snapshot(label):
        received[label] = dataclasses.replace(world.network.traffic).received.copy()

    world.engine.at(3.5, snapshot, "split")
    world.engine.at(5.9, snapshot, "still split")
    sim.run()
    assert world.network.groups == {}  # healed at 6 s
    moved = sum(received["still split"][i] - received["split"][i] for i in lab)
    farm_moved = sum(received["still split"][i] - received["split"][i] for i in farm)
    # nothing crosses while split, but each side keeps talking inside itself
    assert world.network.traffic.refused > 0
    assert moved > 0 or farm_moved > 0


def test_a_node_whose_deadline_stays_in_the_past_fails_the_run_loudly(ci):
    """Virtual time cannot move on while a node is woken again at once for ever (its deadline
    left in the past, as a join's listing grace once did): the run raises instead of hanging."""
    scenario = ci.replace(duration=4.0)
    sim = GossipSim(_world(scenario), scenario.methods[0])
    engine = sim.engine

    def break_node():
        node = sim.machines[0].node
        node.next_deadline = lambda: engine.now  # a deadline always now: a spinning node
        sim.reschedule(0)

    engine.at(1.0, break_node)
    with pytest.raises(RuntimeError, match="machine 0: 1001 wakes at t=1.000"):
        sim.run()


def test_a_checkpoint_lost_or_cut_off_on_the_way_is_still_answered(ci):
    """A fetch whose bytes a lossy link lost, or a partition cut off, was never answered: the
    rejoining node sat in `fetching`, out of training, until its machine next failed. Lost
    bytes go again (TCP); a cut fetch fails and is retried."""
    scenario = ci.replace(churn=Churn(failures=True, mttf_scale=1e-4, mttr_scale=2e-3),
                          duration=12.0)
    world = _world(scenario)
    sim = GossipSim(world, scenario.methods[0])
    size = world.charged.params * 4
    send, spoiled, answered = world.network.send, [], []

    def spoiling_send(src, dst, n, deliver, **kw):
        if kw.get("reply") and n >= size and len(spoiled) < 2:  # a checkpoint's bytes
            spoiled.append((dst, sim.machines[dst].generation))
            how = kw.get("on_lost") if len(spoiled) == 1 else kw.get("on_cut")
            if how is not None:  # (none: the bytes vanish, as they did)
                world.engine.after(0.5, how)
            return True
        return send(src, dst, n, deliver, **kw)

    world.network.send = spoiling_send
    fetched = sim._fetched

    def recording_fetched(i, generation, answer):
        answered.append((i, generation, answer.path is not None))
        fetched(i, generation, answer)

    sim._fetched = recording_fetched
    sim.run()
    assert len(spoiled) == 2, spoiled
    got = {(i, generation): ok for i, generation, ok in answered}
    assert [got.get(key) for key in spoiled] == [True, False], (spoiled, answered)  # resent;
    assert sim.retransmits >= 1  # the cut one failed (the node retries its fetch)


def test_the_coordinators_lost_messages_are_resent_and_cut_ones_retried(ci):
    """What a lossy link loses, TCP resends (a delay: no retry of the worker's exchange, as
    the README says); what a partition cuts off fails the exchange (it hung for good)."""
    world = _world(ci.replace(duration=6.0))
    sim = CoordinatorSim(world, ci.methods[1])
    send, spoiled = world.network.send, []

    def spoiling_send(src, dst, n, deliver, **kw):
        if kw.get("reply") and len(spoiled) < 2:  # the coordinator's first two replies
            spoiled.append(dst)
            how = kw.get("on_lost") if len(spoiled) == 1 else kw.get("on_cut")
            if how is not None:
                world.engine.after(0.1, how)
            return True
        return send(src, dst, n, deliver, **kw)

    world.network.send = spoiling_send
    weights, got = sim._weights, []

    def recording_weights(w, *args):
        got.append(w.index)
        weights(w, *args)

    sim._weights = recording_weights
    result = sim.run()
    assert len(spoiled) == 2 and result["retries"] == 1, (spoiled, result["retries"])
    assert all(i in got for i in spoiled), (spoiled, got)  # both workers went on


def test_a_machine_that_is_down_is_sent_connection_attempts_not_bodies(ci):
    """Heartbeats, pushes and requests to a machine that is down cost a connection attempt
    (`CONNECT_BYTES`), as the runtime's refused or unanswered connection does; they were
    charged their whole bodies, as if delivered. An averaging request there still ends its
    exchange (`Unanswered`)."""
    scenario = ci.replace(duration=10.0)
    world = _world(scenario)
    sim = GossipSim(world, scenario.methods[0])
    victim = next(m.index for m in world.members if m.device.name == "server")
    send, after = world.network.send, []

    def recording_send(src, dst, n, deliver, **kw):
        if dst == victim and sim.machines[victim].node is None:
            after.append(n)
        return send(src, dst, n, deliver, **kw)

    world.network.send = recording_send
    unanswered = []
    handle = sim.handle

    def recording_handle(i, event):
        if type(event) is Unanswered and event.peer == world.members[victim].node_id:
            unanswered.append(i)
        return handle(i, event)

    sim.handle = recording_handle
    world.engine.at(4.0, sim.crash, victim)
    sim.run()
    assert len(after) >= 10  # the others went on talking to it until they saw it dead
    assert set(after) == {CONNECT_BYTES}, sorted(set(after))[:5]
    assert unanswered  # partners that opened an exchange with it heard it end


def test_a_message_sent_while_a_machine_was_down_is_not_delivered_when_it_is_back(ci):
    """A connection attempt is no message: a machine back before the attempt's bytes arrive
    got the message for 100 bytes (a review of the change above)."""
    scenario = ci.replace(duration=6.0)
    world = _world(scenario)
    sim = GossipSim(world, scenario.methods[0])
    victim = next(m.index for m in world.members if m.device.name == "server")
    sender = next(m.index for m in world.members if m.index != victim)
    got = []
    handle = sim.handle

    def recording_handle(i, event):
        if i == victim and getattr(event, "message", None) is not None:
            got.append(event.message)
        return handle(i, event)

    sim.handle = recording_handle
    marked = []

    def probe():
        sim.crash(victim)
        node = sim.machines[sender].node
        send = node.control.wrap(world.members[victim].node_id, world.members[victim].addr,
                                 Notify())
        marked.append(send.envelope)
        sim.send(sender, send)
        sim.come_back(victim)  # back at once, before the attempt arrives

    world.engine.at(3.0, probe)
    sim.run()
    assert marked and not any(e is marked[0] for e in got)
