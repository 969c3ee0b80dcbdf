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
