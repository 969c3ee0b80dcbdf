"""`GET /metrics`: the node in Prometheus's text format, through `prometheus_client`.

One registry per node with the process and platform collectors, build info, and a collector
that reads the node's status document (the one `/v1/status` serves) at every scrape:
counters (`_total`) for what only grows in this process -- tokens, bytes, refusals -- gauges
for what moves both ways (loss, term, leadership, members by state) and for the step and
sample counts (a restart resumes them from its checkpoint, lower than last scraped: as
counters, Prometheus read that as a reset and `increase()` spiked by the whole count), a
histogram of training step times (its `_count`: this process's steps, for rates), and the
RTT and bandwidth of at most `MAX_PEERS` live peers (labels stay bounded). Read-only: it never
changes the node.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from p2ptrain import __version__

MAX_PEERS = 64  # peers with their own RTT/bandwidth series, at most
MEMBER_STATES = ("alive", "suspect", "dead", "left")  # p2ptrain_members' series, always
LIVE_STATES = ("alive", "suspect")  # members whose RTT and bandwidth are reported
CONTENT_TYPE = CONTENT_TYPE_LATEST

COUNTERS = (  # status key, metric name (without _total), help
    ("bytes_in", "p2ptrain_received_bytes", "protocol bytes received from members"),
    ("bytes_out", "p2ptrain_sent_bytes", "protocol bytes addressed to members (gradient "
     "pushes the outbox drops for a busy peer included: upload_bytes is what left)"),
    ("upload_bytes", "p2ptrain_upload_bytes", "bytes through the upload cap (all bodies sent)"),
    ("skipped_steps", "p2ptrain_skipped_steps", "steps discarded for non-finite values"),
)
GAUGES = (
    ("step", "p2ptrain_step", "the optimiser step this node's replica is at (a restart "
     "resumes it from its checkpoint)"),
    ("samples", "p2ptrain_samples", "samples this node's replica was trained on (resumed "
     "likewise)"),
    ("swarm_samples", "p2ptrain_swarm_samples", "the swarm's sample count as this node knows "
     "it"),
    ("loss", "p2ptrain_train_loss", "training loss of the last step (nats/token)"),
    ("eval_loss", "p2ptrain_eval_loss", "last held-out loss (nats/token)"),
    ("average_eval_loss", "p2ptrain_average_eval_loss",
     "last held-out loss of the weights' average that checkpoints carry (train.ema)"),
    ("term", "p2ptrain_term", "election term this node follows"),
    ("consensus_distance", "p2ptrain_consensus_distance",
     "RMS distance to the last averaging partner"),
)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


class NodeCollector:
    """Metric families from a status document, built at every scrape."""

    def __init__(self, status: Callable[[], dict[str, Any]]):
        self.status = status

    def collect(self):
        doc = self.status()
        info = InfoMetricFamily("p2ptrain_build", "the p2ptrain release and Python running")
        info.add_metric([], {"version": __version__, "python": platform.python_version()})
        yield info
        for key, name, text in COUNTERS:
            value = _number(doc.get(key))
            if value is not None:
                yield CounterMetricFamily(name, text, value=value)
        for key, name, text in GAUGES:
            value = _number(doc.get(key))
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        yield GaugeMetricFamily("p2ptrain_is_leader", "1 while this node is the checkpoint "
                                "leader", value=1.0 if doc.get("is_leader") else 0.0)
        members = GaugeMetricFamily("p2ptrain_members", "members known, by state",
                                    labels=["state"])
        states = dict.fromkeys(MEMBER_STATES, 0)  # zeros too: an alert on no live member
        for member in doc.get("members", []):
            states[member["state"]] = states.get(member["state"], 0) + 1
        for state, n in sorted(states.items()):
            members.add_metric([state], n)
        yield members
        yield from self._peers(doc)
        yield from self._steps(doc.get("steps") or {})
        refused = CounterMetricFamily("p2ptrain_refused_requests", "requests refused, by "
                                      "reason", labels=["reason"])
        for key, value in sorted((doc.get("runtime") or {}).items()):
            if key.startswith("refused_") and _number(value) is not None:
                refused.add_metric([key[len("refused_"):]], value)
        yield refused
        served = _number((doc.get("runtime") or {}).get("served_bytes", 0))
        yield CounterMetricFamily("p2ptrain_checkpoint_served_bytes", "checkpoint bytes this "
                                  "node served to fetchers (also under the upload cap)",
                                  value=served or 0.0)

    def _peers(self, doc: dict[str, Any]):
        rtt = GaugeMetricFamily("p2ptrain_peer_rtt_seconds", "probe round trip to a member",
                                labels=["peer"])
        bandwidth = GaugeMetricFamily("p2ptrain_peer_bandwidth_bytes_per_second",
                                      "measured transfer rate from a member", labels=["peer"])
        live = [m for m in doc.get("members", []) if m.get("state") in LIVE_STATES]  # a dead
        for member in sorted(live, key=lambda m: m["node_id"])[:MAX_PEERS]:  # one's figures
            peer = member["node_id"][:12]  # are no measurement of now
            if _number(member.get("rtt_ms")) is not None:
                rtt.add_metric([peer], member["rtt_ms"] / 1e3)
            if _number(member.get("bandwidth")) is not None:
                bandwidth.add_metric([peer], member["bandwidth"])
        yield rtt
        yield bandwidth

    def _steps(self, steps: dict[str, Any]):
        if not steps:
            return
        yield CounterMetricFamily("p2ptrain_tokens", "tokens trained on by this node's steps "
                                  "(rate() gives tokens/s)", value=steps["tokens"])
        buckets = [(str(bound), count) for bound, count in steps["buckets"]]
        yield HistogramMetricFamily("p2ptrain_step_seconds", "compute time of one training "
                                    "step", buckets=[*buckets, ("+Inf", steps["count"])],
                                    sum_value=steps["seconds"])


def registry_for(status: Callable[[], dict[str, Any]]) -> CollectorRegistry:
    """The node's registry: its own families plus the process and platform collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    registry.register(NodeCollector(status))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
