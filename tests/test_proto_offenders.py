"""A member whose values keep being refused is named and ignored for a cool-off (issue 13,
item 13): in the in-memory training cluster, virtual time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from p2ptrain.proto import wire
from p2ptrain.proto.events import Offender, RemoteError
from p2ptrain.proto.gossip.messages import GradientPush
from p2ptrain.proto.messages import Ping
from p2ptrain.proto.offenders import Offenders
from tests.test_node import MODEL, _malformed_bodies, cluster, envelope_from, gradient_chunk


def test_a_burst_of_refusals_counts_once_towards_the_limit():
    """One refused vector of a big model is hundreds of chunk messages within milliseconds:
    it is one refusal towards the limit (every message still counts in the total)."""
    o = Offenders(limit=3, window=10.0, cooloff=100.0)
    assert not any(o.refused(0.001 * i, "a", "chunk") for i in range(500))
    assert o.records["a"].total == 500 and not o.ignored(1.0, "a")
    assert not o.refused(1.0, "a", "x") and not o.ignored(1.5, "a")
    assert o.refused(2.0, "a", "x") and o.ignored(2.5, "a")  # the third, seconds apart


def test_a_burst_of_refusals_makes_an_offender_and_the_window_forgets():
    o = Offenders(limit=3, window=10.0, cooloff=100.0)
    assert not o.refused(0.0, "a", "x") and not o.refused(5.0, "a", "x")
    assert not o.refused(16.0, "a", "x")  # the first two left the window
    assert not o.refused(17.0, "a", "x")
    assert o.refused(18.0, "a", "bad") and o.ignored(50.0, "a") and not o.ignored(118.5, "a")
    assert o.status(50.0)[0]["node_id"] == "a" and o.status(50.0)[0]["refusals"] == 5
    assert not Offenders(limit=0, window=10, cooloff=10).refused(0.0, "a", "x")  # 0: never


@pytest.mark.slow
def test_a_member_sending_bad_values_is_ignored_then_readmitted():
    c = cluster(3, step_seconds=0.5)
    c.run_until(3.2)
    node = c.training_node(0)
    bad_id = c.nodes[1].info.node_id
    assert (bad_id, c.nodes[1].info.addr) in node.alive_peers()
    body = _malformed_bodies(c)["checksum"]
    kinds = []
    for _ in range(node.config.offender_refusals):
        c.run_for(1.1)  # refusals over a second apart (a burst counts as one: see above)
        kinds.append([type(a) for a in c.inject(0, envelope_from(c, 1, 0, body),
                                                c.nodes[1].info.addr)])
    assert kinds[:-1] == [[RemoteError]] * (len(kinds) - 1)
    assert kinds[-1] == [RemoteError, Offender]
    row = node.status()["offenders"][0]
    assert row["node_id"] == bad_id and row["ignored_for_s"] > 0
    assert bad_id not in [i for i, _ in node.alive_peers()]
    # its messages, valid or not, are dropped unread while it is ignored
    ping = envelope_from(c, 1, 0, Ping(99, c.nodes[0].info.node_id))
    assert c.inject(0, wire.encode(ping), c.nodes[1].info.addr) == []
    assert node.trainer.stats["ignored_offender_messages"] == 1
    # after the cool-off it is heard again
    c.run_for(node.config.offender_cooloff + 1.0)
    assert bad_id in [i for i, _ in node.alive_peers()]


def test_pushes_from_a_member_not_yet_in_our_list_are_refused_but_no_offence():
    """Membership spreads by gossip: a node can know us, and push to us every step, before our
    list has it. Those pushes are refused (no effect) but do not make it an offender -- that
    ignored it for 5 minutes (CI: a 4-node swarm whose member then used one peer's gradients)."""
    c = cluster(3, step_seconds=0.5)
    c.run_until(0.0)
    node = c.training_node(0)
    early = c.nodes[1].info.node_id
    assert node.control.member(early) is None  # the lists have not spread yet
    grad = np.full(MODEL.space.size, 0.01, np.float32)
    for _ in range(node.config.offender_refusals + 2):
        push = envelope_from(c, 1, 0, GradientPush(1, 2.0, gradient_chunk(early, grad)))
        actions = c.inject(0, push, c.nodes[1].info.addr)
        assert [type(a) for a in actions] == [RemoteError], actions
        assert "not a member" in actions[0].reason and not actions[0].offence
    assert node.status()["offenders"] == [] and not node.offenders.ignored(0.0, early)
    c.run_until(6.0)  # once the lists have spread, its gradients are used
    assert node.trainer.mixer.used[bytes.fromhex(early)] > 0


def test_a_restarted_member_once_outbound_only_may_lead_before_our_record_of_it_is_new():
    """A member that once went outbound-only (a laptop asleep looked unreachable) restarts
    accepting connections and leads: its new life's messages carry its claim before our
    record of it is updated. They are not refused as an outbound-only member's claim (every
    one was: the leader became an offender within seconds)."""
    c = cluster(3, step_seconds=0.5)
    c.run_until(6.0)
    lead = c.training_node(0).control.leader
    at = next(i for i, n in enumerate(c.nodes) if n.info.node_id == lead)
    to = (at + 1) % 3
    node = c.training_node(to)
    record = node.control.membership.table.members[lead]
    record.info = dataclasses.replace(record.info, outbound_only=True)  # its previous life's
    for k in range(2 * node.config.offender_refusals):
        env = envelope_from(c, at, to, Ping(1000 + k, c.nodes[to].info.node_id))
        env = dataclasses.replace(env, header=dataclasses.replace(
            env.header, incarnation=record.incarnation + 1))  # its new life
        actions = c.inject(to, env, c.nodes[at].info.addr)
        assert not [a for a in actions if type(a) in (RemoteError, Offender)], actions
    # the same claim in the life our record describes is still refused
    env = envelope_from(c, at, to, Ping(1, c.nodes[to].info.node_id))
    env = dataclasses.replace(env, header=dataclasses.replace(
        env.header, incarnation=record.incarnation))
    refused = [a for a in c.inject(to, env, c.nodes[at].info.addr) if type(a) is RemoteError]
    assert refused and "outbound-only member cannot lead" in refused[0].reason
