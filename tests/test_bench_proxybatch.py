"""tests/bench/proxybatch.py: the proxy's steps to a target alone and as averaged replicas."""

from __future__ import annotations

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
