"""`GET /metrics` of a live node, parsed with prometheus_client's own parser: conventional
names and types (counters end in _total, a histogram of step times, build info, process
metrics), and values that move while the node trains."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes]


def _scrape(addr: str) -> dict:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = resp.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(family, suffix: str = "", **labels) -> float:
    return next(s.value for s in family.samples
                if s.name == family.name + suffix and all(s.labels.get(k) == v
                                                          for k, v in labels.items()))


def test_metrics_parse_with_conventional_names_and_types(tmp_path):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [])
        b = lab.start("b", ports[1], [a.addr])
        wait_for("both to train", lambda: all(p.status()["step"] > 10 for p in (a, b)), 60)
        first = _scrape(a.addr)
        types = {
            "p2ptrain_step": "gauge", "p2ptrain_samples": "gauge",
            "p2ptrain_swarm_samples": "gauge", "p2ptrain_received_bytes": "counter",
            "p2ptrain_sent_bytes": "counter", "p2ptrain_upload_bytes": "counter",
            "p2ptrain_tokens": "counter", "p2ptrain_refused_requests": "counter",
            "p2ptrain_checkpoint_served_bytes": "counter",
            "p2ptrain_train_loss": "gauge", "p2ptrain_term": "gauge",
            "p2ptrain_is_leader": "gauge", "p2ptrain_members": "gauge",
            "p2ptrain_peer_rtt_seconds": "gauge", "p2ptrain_step_seconds": "histogram",
            "p2ptrain_build_info": "gauge", "process_cpu_seconds": "counter",
            "process_resident_memory_bytes": "gauge", "python_info": "gauge",
        }
        for name, kind in types.items():
            assert name in first and first[name].type == kind, (name, first.get(name))
        assert "p2ptrain_average_eval_loss" not in first  # no train.ema: no average
        # (one late probe ack leaves the other suspect for a moment: the scrape is retried)
        def alive_in_scrape() -> dict | None:
            scraped = _scrape(a.addr)
            states = {s.labels.get("state"): s.value for s in scraped["p2ptrain_members"].samples}
            return scraped if states.get("alive") == 1 else None

        first = wait_for("the other node alive in a scrape", alive_in_scrape, 30)
        hist = first["p2ptrain_step_seconds"]
        count = _value(hist, "_count")
        assert count > 0 and _value(hist, "_bucket", le="+Inf") == count
        served = _value(first["p2ptrain_checkpoint_served_bytes"], "_total")
        assert served == a.status()["runtime"].get("served_bytes", 0)  # the join is over
        build = next(s for s in first["p2ptrain_build_info"].samples)
        assert build.labels["version"] and build.labels["python"]
        assert {s.labels["state"] for s in first["p2ptrain_members"].samples} == {
            "alive", "suspect", "dead", "left"}  # zeros too: an alert on none alive fires
        wait_for("the counters to move", lambda: _value(
            _scrape(a.addr)["p2ptrain_tokens"], "_total") > _value(first["p2ptrain_tokens"],
                                                                  "_total"), 30)
        assert all(c == 0 for c in lab.stop_all())


def test_with_ema_a_node_reports_the_loss_of_the_average_its_checkpoints_carry(tmp_path):
    """A networked node with `train.ema` evaluates the average of its weights beside them:
    the eval log line and event, the status document and a gauge say its held-out loss."""
    config = SMALL_SWARM_TOML.replace("[train]\n", "[train]\nema = 0.99\n")
    with SwarmLab(tmp_path, config) as lab:
        [port] = free_ports(1)
        a = lab.start("a", port, [], env=lab.env(P2PTRAIN_NODE_MIN_PEERS="0"))
        evals = wait_for("an evaluation of the average", lambda: [
            e for e in a.events() if e.get("event") == "eval"
            and e.get("average_eval_loss") is not None], 90)
        assert "the average in checkpoints" in evals[0]["message"]
        assert evals[0]["average_eval_loss"] > 0
        doc = a.status()
        gauge = _value(_scrape(a.addr)["p2ptrain_average_eval_loss"])
        assert gauge > 0 and doc["average_eval_loss"] > 0
        assert all(c == 0 for c in lab.stop_all())


def test_live_members_get_their_series_before_dead_ones_take_the_slots():
    from p2ptrain.net.metrics import MAX_PEERS, NodeCollector

    members = [{"node_id": f"{i:032x}", "state": "dead", "rtt_ms": 5.0, "bandwidth": 1.0}
               for i in range(MAX_PEERS + 5)]
    members.append({"node_id": "f" * 32, "state": "alive", "rtt_ms": 7.0, "bandwidth": 2.0})
    families = {f.name: f for f in NodeCollector(lambda: {"members": members}).collect()}
    assert [s.labels["peer"] for s in families["p2ptrain_peer_rtt_seconds"].samples] == [
        "f" * 12]
    states = {s.labels["state"]: s.value for s in families["p2ptrain_members"].samples}
    assert states == {"alive": 1, "suspect": 0, "dead": MAX_PEERS + 5, "left": 0}
