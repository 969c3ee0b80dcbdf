"""The networked node's progress line: built from the status document; a line that says
nothing new is not printed again (until a quiet minute has passed)."""

from __future__ import annotations

from p2ptrain.net.progress import Repeats, progress_line, say_leader

DOC = {"node_id": "a" * 32, "step": 12, "loss": 2.5, "eval_loss": None, "term": 3,
       "members": [{"state": "alive"}, {"state": "dead"}], "leader": "a" * 32,
       "swarm_samples": 5000, "total_samples": 10000, "samples": 96, "phase": "training"}


def test_the_line_reads_the_status_document():
    text, fields = progress_line(DOC, 1500.0, 0.0)
    assert "step     12" in text and "loss 2.500" in text and "held-out -" in text
    assert "peers 1/2" in text and "leader me (term 3)" in text and "(50.0%)" in text
    assert fields["peers"] == 1 and fields["up_bytes_per_s"] == 0.0


def test_an_unchanged_line_is_held_back_until_a_quiet_minute():
    r = Repeats(quiet=60.0)
    text, _ = progress_line(DOC, 0.0, 0.0)
    assert r.fresh(text, 0.0) and not r.fresh(text, 5.0) and not r.fresh(text, 59.0)
    assert r.fresh(text, 61.0)
    moved, _ = progress_line({**DOC, "step": 13}, 0.0, 0.0)
    assert r.fresh(moved, 62.0)


def test_a_leader_that_stops_does_not_say_its_lease_lapsed():
    from p2ptrain.proto import LeaderChanged

    said = []

    class Reporter:
        def info(self, text, **fields):
            said.append(text)

    say_leader(Reporter(), LeaderChanged(3, None), "a" * 32, stopping=True)
    say_leader(Reporter(), LeaderChanged(3, None), "a" * 32)
    assert said == ["no leader: this node is stopping", "no leader: lease lapsed"]
