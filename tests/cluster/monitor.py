"""Invariant checks for a running `Cluster`: an observer that watches every delivery and
every action, and the checks that need the cluster's ground truth (who is really up, who
can really talk to whom).

Safety, checked online at every step (issue 4's invariant 1):
- leadership claims are unique: no two share (term, priority, capability, id);
- a leader that hears a higher claim (from a member) steps down in the same step, and never
  claims or checkpoints below a claim it has heard;
- checkpoints are written by the current leader of their term, and no two share
  (term, leader, step).
Membership (invariant 5) is recorded here -- every death each node declares -- and judged by
the schedule runner, which knows the crashes. The monitor never changes the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2ptrain.proto import wire
from p2ptrain.proto.events import (
    Action,
    Event,
    LeaderChanged,
    MemberDown,
    Received,
    Refused,
    RemoteError,
    SaveCheckpoint,
    Send,
)
from p2ptrain.proto.messages import Envelope
from p2ptrain.proto.records import claim_key
from tests.cluster.harness import Observer

Key = tuple[int, int, float, str]


@dataclass
class Death:
    time: float
    observer: int  # node that declared it
    node: int  # node declared dead
    incarnation: int


@dataclass
class Monitor(Observer):
    """Observer for `Cluster`; collects `violations` (empty when all invariants held)."""

    violations: list[str] = field(default_factory=list)
    claims: dict[Key, tuple[float, int]] = field(default_factory=dict)
    checkpoint_ids: set[tuple[int, str, int]] = field(default_factory=set)
    checkpoints: list[tuple[float, int, int, int]] = field(default_factory=list)  # t,node,term,step
    heard: dict[int, Key] = field(default_factory=dict)  # highest claim each node has heard
    deaths: list[Death] = field(default_factory=list)
    _before: tuple[int, bool, Key | None, bool] | None = None

    def fail(self, cluster: Any, message: str) -> None:
        self.violations.append(f"t={cluster.now:.3f}: {message}")

    # -- observer hooks -----------------------------------------------------------------------

    def on_restart(self, cluster: Any, i: int) -> None:
        self.heard.pop(i, None)

    def before_deliver(self, cluster: Any, i: int, payload: Any) -> None:
        ctl = cluster.nodes[i].control
        env = payload if isinstance(payload, Envelope) else _decode(payload)
        if env is None:
            self._before = None
            return
        own = _own_key(ctl)
        members = ctl.membership.table.members
        view = env.header.view
        leader_known = view is not None and view.leader in members
        self._before = (i, ctl.is_leader, own, env.header.sender in members, leader_known)

    def on_actions(self, cluster: Any, i: int, event: Event, actions: list[Action]) -> None:
        node = cluster.nodes[i]
        ctl = node.control
        if type(event) is Received:
            self._check_delivery(cluster, i, event, actions)
        for a in actions:
            kind = type(a)
            if kind is Send:
                continue
            if kind is LeaderChanged and a.leader == node.info.node_id:
                key = claim_key(a.term, node.info)
                if key in self.claims:
                    self.fail(cluster, f"node {i} claims {key[:1]} twice (first at "
                                       f"{self.claims[key][0]:.3f})")
                self.claims[key] = (cluster.now, i)
                heard = self.heard.get(i)
                if heard is not None and key <= heard:
                    self.fail(cluster, f"node {i} claims term {a.term} below a claim it heard "
                                       f"(term {heard[0]})")
            elif kind is SaveCheckpoint:
                self._check_checkpoint(cluster, i, a)
            elif kind is MemberDown and not a.left:
                self.deaths.append(Death(cluster.now, i, cluster.ids[a.node_id], a.incarnation))
        if ctl is not None and ctl.is_leader and i in self.heard:
            own = _own_key(ctl)
            heard = self.heard[i]
            if own < heard:
                self.fail(cluster, f"node {i} still leads at {own[:1]} after hearing {heard[:1]}")

    def _check_delivery(self, cluster: Any, i: int, event: Received,
                        actions: list[Action]) -> None:
        before, self._before = self._before, None
        if before is None or before[0] != i or not before[3]:
            return
        for a in actions:
            kind = type(a)
            if kind is RemoteError or (kind is Refused and not a.by_peer):
                return
        env = event.message if isinstance(event.message, Envelope) else _decode(event.message)
        view = env.header.view if env is not None else None
        if view is None or view.leader == cluster.nodes[i].info.node_id:
            return
        if not before[4] and not any(u.node_id == view.leader and u.kind == "alive"
                                     for u in env.header.updates):
            return  # names no member when it is judged (issue 13): not a claim it heard
        heard = self.heard.get(i)
        if heard is not None and view.term == heard[0] and view.leader == heard[3]:
            return  # the claim it already heard, relayed again
        key = view.key()
        if before[1] and before[2] is not None and key > before[2]:
            ctl = cluster.nodes[i].control
            if ctl.is_leader and _own_key(ctl) < key:
                self.fail(cluster, f"leader {i} heard higher claim {key[:1]} and kept leading")
        if key > self.heard.get(i, key):
            self.heard[i] = key
        else:
            self.heard.setdefault(i, key)

    def _check_checkpoint(self, cluster: Any, i: int, a: SaveCheckpoint) -> None:
        node = cluster.nodes[i]
        ctl = node.control
        ident = (a.term, a.leader, a.step)
        if ident in self.checkpoint_ids:
            self.fail(cluster, f"checkpoint {ident[0]}/{ident[2]} written twice")
        self.checkpoint_ids.add(ident)
        if a.leader != node.info.node_id or not ctl.is_leader or ctl.term != a.term:
            self.fail(cluster, f"node {i} checkpoints term {a.term} without leading it")
        heard = self.heard.get(i)
        if heard is not None and claim_key(a.term, node.info) < heard:
            self.fail(cluster, f"node {i} checkpoints term {a.term} after hearing {heard[:1]}")
        self.checkpoints.append((cluster.now, i, a.term, a.step))


def _own_key(ctl: Any) -> Key | None:
    view = ctl.election.view
    return view.key() if view is not None else None


def _decode(payload: Any) -> Envelope | None:
    try:
        return wire.decode(payload)
    except Exception:
        return None
