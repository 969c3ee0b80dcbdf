"""tests/bench/pairs.py: a small swarm averaging every step, in virtual time."""

from __future__ import annotations

import pytest

from tests.bench import pairs


def test_two_nodes_average_once_a_step_and_stay_close(capsys):
    distances, counts = pairs.run(2, 1, 8.0)
    # a step of each, one exchange between the two, not one each (44 in 22 steps before
    # 2026-12-05: the peer a node had just answered is no partner at its step)
    assert counts["steps"] >= 10 and counts["average_started"] <= 1.3 * counts["steps"], counts
    done = counts["average_started"] - counts["average_declined_crossing"]
    assert 2 * done - 2 <= counts["average_applied"] <= 2 * done, counts  # (one in flight)
    assert all(d < 1e-2 for d in distances), distances
    assert pairs.main(["--nodes", "2", "--seeds", "1", "--seconds", "2"]) == 0
    assert "2 nodes, seed 1: distance" in capsys.readouterr().out
    for argv in (["--nodes", "1"], ["--seeds", "x"], ["--seconds", "0"]):
        with pytest.raises(SystemExit) as refused:
            pairs.main(argv)
        assert refused.value.code == 2
