"""tests/bench/weightavg.py: averages of weights kept beside a simulation, evaluated with the
same held-out windows as the simulation's own models."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.bench import weightavg


def test_an_average_starts_at_the_weights_and_decays_as_a_nodes_does():
    avg = weightavg.Averages(0.75)
    avg.update("a", np.array([4.0, 8.0], dtype=np.float32))
    avg.update("a", np.array([8.0, 0.0], dtype=np.float32))
    avg.update("b", np.array([1.0, 1.0], dtype=np.float32))
    d = 2 / 11  # young: (1 + 1) / (10 + 1), below beta (p2ptrain.learner.ema_decay)
    np.testing.assert_allclose(avg.of["a"], [4 * d + 8 * (1 - d), 8 * d], rtol=1e-6)
    assert avg.of["b"].tolist() == [1.0, 1.0]
    for _ in range(200):  # old: beta itself
        avg.update("b", np.array([3.0, 1.0], dtype=np.float32))
    before = avg.of["b"].copy()
    avg.update("b", np.array([7.0, 1.0], dtype=np.float32))
    np.testing.assert_allclose(avg.of["b"], 0.75 * before + 0.25 * np.array([7.0, 1.0]))
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError):
            weightavg.Averages(bad)
    for argv in (["--beta", "1"], ["--seeds", "x"], ["--duration", "0"],
                 ["--scenario", "seed-1b-lora-ema"]):  # averaged already
        with pytest.raises(SystemExit) as refused:
            weightavg.main(argv)
        assert refused.value.code == 2


def test_at_beta_0_a_servers_average_is_its_weights_and_gossip_gets_every_curve(capsys):
    """40 simulated seconds of the 1B-LoRA fleet: the server's average, updated after each of
    its steps, is then its weights at every evaluation; the gossip run evaluates the leader,
    its average and the servers' means at the same times."""
    runs = weightavg.main(["--scenario", "seed-1b-lora", "--seeds", "1", "--duration", "40",
                           "--eval-every", "20", "--beta", "0"])
    solo = runs[weightavg.SOLO, 1].points
    assert len(solo["weights"]) >= 2 and solo["average"] == solo["weights"][1:]  # t 0: no step
    gossip = runs[weightavg.GOSSIP, 1].points
    times = [t for t, _ in gossip["tier mean"]]
    assert times and times[-1] == 40.0
    for name in ("leader", "leader average", "tier average mean"):
        assert [t for t, _ in gossip[name]] == times[-len(gossip[name]):]
        assert all(math.isfinite(loss) and loss > 0 for _, loss in gossip[name])
    out = capsys.readouterr().out
    assert "one server alone: weights" in out and "tier average mean" in out
