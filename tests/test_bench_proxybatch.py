"""tests/bench/proxybatch.py: the proxy's steps to a target alone and as averaged replicas."""

from __future__ import annotations

import numpy as np
import pytest

from sims.fleet import Training
from sims.scenario import load
from tests.bench import proxybatch


def test_steps_to_a_loose_target_alone_and_averaged_are_counted_and_repeatable():
    training = Training(load("seed-1b-lora"))
    alone = proxybatch.steps_alone(training, 4, 4e-3, 4.5, 400)
    assert alone[0] is not None and alone[0] % proxybatch.CHECK_EVERY == 0 and alone[1] <= 4.5
    assert proxybatch.steps_alone(training, 4, 4e-3, 4.5, 400) == alone
    averaged = proxybatch.steps_averaged(training, 2, 1, 4e-3, 4.5, 400)
    assert averaged[0] is not None and averaged[1] <= 4.5
    never = proxybatch.steps_alone(training, 1, 4e-3, 0.5, 50)  # out of reach in 50 steps
    assert never[0] is None and never[1] > 0.5


def test_a_fleet_mixed_ideally_reaches_a_loose_target_and_repeats():
    """Two fast replicas and a slow one, mixed every 2 simulated seconds: the time is a
    multiple of the evaluation period, the same for the same seed."""
    training = Training(load("seed-1b-lora"))
    times = [0.5, 0.5, 3.0]
    for mode in ("all", "pairs"):
        when, loss = proxybatch.fleet_time(training, times, 2.0, mode, 4e-3, 4.5, 400.0, 1)
        assert when is not None and when % proxybatch.FLEET_CHECK == 0 and loss <= 4.5
        assert proxybatch.fleet_time(training, times, 2.0, mode, 4e-3, 4.5, 400.0, 1) == (
            when, loss)
    batched = proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 4.5, 400.0, 1, [2, 2, 1])
    assert batched[0] is not None and batched[1] <= 4.5  # each machine at its own batch
    assert proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 4.5, 400.0, 1,
                                 [2, 2, 1]) == batched
    never = proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 0.5, 40.0, 1)
    assert never[0] is None and never[1] > 0.5
    shared = proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 4.5, 400.0, 1,
                                   swarm_count=True)  # the schedule on the swarm's samples
    assert shared[0] is not None and shared[1] <= 4.5


def test_a_finer_evaluation_grid_and_the_fastest_machines_alone(capsys):
    """`check` evaluates on a finer grid (a time no later than the 20 s grid's, on its own
    grid); `--first 1` runs one machine of those chosen; bad values are refused."""
    training = Training(load("seed-1b-lora"))
    times = [0.5, 0.5, 3.0]
    coarse = proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 4.5, 400.0, 1)
    fine = proxybatch.fleet_time(training, times, 2.0, "all", 4e-3, 4.5, 400.0, 1, check=4.0)
    assert fine[0] is not None and fine[0] % 4.0 == 0 and fine[0] <= coarse[0]
    proxybatch.main(["--scenario", "seed-1b-lora", "--fleet", "--slowest", "1", "--first", "1",
                     "--period", "2", "--modes", "all", "--lrs", "4e-3", "--target", "4.5",
                     "--horizon", "200", "--check", "4"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("fleet")]
    assert len(lines) == 1 and " of 1: " in lines[0] and "server" in lines[0]
    for bad in (["--check", "0"], ["--first", "-1"]):
        with pytest.raises(SystemExit) as refused:
            proxybatch.main(["--fleet", *bad])
        assert refused.value.code == 2


def test_with_train_ema_the_first_replicas_average_is_evaluated():
    """`--ema`: every replica keeps train.ema's average and the first one's is what is
    evaluated -- early in training it lags the weights, so its loss is higher."""
    training = Training(load("seed-1b-lora"))
    times = [0.5, 0.5, 3.0]
    plain = proxybatch.fleet_time(training, times, 2.0, "pairs", 4e-3, 0.5, 40.0, 1)
    averaged = proxybatch.fleet_time(training, times, 2.0, "pairs", 4e-3, 0.5, 40.0, 1,
                                     ema=0.99)
    assert plain[0] is None and averaged[0] is None
    assert averaged[1] > plain[1]
    assert proxybatch.fleet_time(training, times, 2.0, "pairs", 4e-3, 0.5, 40.0, 1,
                                 ema=0.99) == averaged


def test_pooled_gradients_reach_a_loose_target_and_repeat():
    """Mode "grads": one vector stepped with the machines' completed gradients, whole or
    the slower machines' top-k with error feedback; the same inputs give the same time."""
    training = Training(load("seed-1b-lora"))
    times, batches = [0.5, 0.5, 3.0], [2, 2, 1]
    for topk in (1.0, 0.05):
        when, loss = proxybatch.pooled_time(training, times, batches, 0.5, 4e-3, 4.5, 400.0,
                                            topk=topk)
        assert when is not None and when % proxybatch.FLEET_CHECK == 0 and loss <= 4.5
        assert proxybatch.pooled_time(training, times, batches, 0.5, 4e-3, 4.5, 400.0,
                                      topk=topk) == (when, loss)
    never = proxybatch.pooled_time(training, times, batches, 0.5, 4e-3, 0.5, 40.0)
    assert never[0] is None and never[1] > 0.5


def test_top_k_keeps_the_largest_magnitudes():
    values = np.array([0.5, -3.0, 0.1, 2.0, -0.2, 1.0], np.float32)
    assert proxybatch._top_k(values, 0.5).tolist() == [0.0, -3.0, 0.0, 2.0, 0.0, 1.0]
    assert proxybatch._top_k(np.array([1.0, -2.0], np.float32), 0.01).tolist() == [0.0, -2.0]
