"""The memory model (p2ptrain/memplan.py, issue 15): its parts, the rwkv family, the largest
trainable model, and its prediction against a real node's peak RSS."""

from __future__ import annotations

from dataclasses import replace

import pytest

from p2ptrain import memplan
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.owed8 import Owed8
from p2ptrain.proto.gossip.trainer import held_capacity

N = 100_000_000


def test_training_needs_16_bytes_per_parameter_plus_what_is_asked_for():
    base = memplan.footprint(N, 5_000_000)
    assert base.weights == base.gradient == 4 * N and base.moments == 8 * N
    assert base.total == memplan.OVERHEAD + 16 * N + 5_000_000
    assert memplan.footprint(N, 0, accum=2).micro_gradient == 4 * N
    pushing = memplan.footprint(N, 0, pushes=True, queue_bytes=10)
    assert pushing.error_feedback == 4 * N and pushing.push_queue == 10
    networked = memplan.footprint(N, 0, networked=True, average_part=1000)
    assert networked.averaging == 4 * (held_capacity(N) + 1000)
    assert networked.overhead > base.overhead
    big = memplan.footprint(10**9, 0, networked=True)
    assert big.averaging / 10**9 < 0.52  # an eighth of the model, and one part
    assert memplan.footprint(N, 0, corpus_tokens=1000).corpus == 1125
    outer = memplan.footprint(N, 0, pushes=True, outer=True, queue_bytes=10)
    feedback = Owed8.bytes_for(N)  # 8 bits and a scale per 256 coordinates
    assert N < feedback < 1.02 * N
    assert outer.outer == 2 * N + feedback and outer.error_feedback == 0
    assert outer.push_queue == 10
    kept = memplan.footprint(N, 0, pushes=True, outer=True, outer_rewind=False)
    assert kept.outer == feedback  # keeping the owed progress: the error feedback alone
    wide = memplan.footprint(N, 0, outer=True, outer_rewind=False, outer_feedback_bits=16)
    assert wide.outer == 2 * N  # bfloat16


def test_the_rwkv_family_and_its_activations():
    config = memplan.rwkv_shape(768)
    assert (config.n_layer, config.n_embd, config.vocab_size) == (12, 768, 256)
    assert memplan.rwkv_shape(768, RWKVConfig(vocab_size=50277)).vocab_size == 50277
    model = RWKV(config)
    f = memplan.rwkv_footprint(config, batch=8, accum=2)
    assert f.activations == 4 * model.activation_bytes_per_sample()
    assert f.weights == 4 * model.space.n_params and f.micro_gradient == f.weights


def test_largest_trainable_is_the_last_member_that_fits():
    budget = 4 * 2**30 - 0.6e9
    params, config = memplan.largest_trainable(budget)
    assert memplan.rwkv_footprint(config).total <= budget
    bigger = memplan.rwkv_shape(config.n_embd + memplan.CHANNEL_STEP)
    assert memplan.rwkv_footprint(bigger).total > budget
    assert params == RWKV(config).space.n_params and 100e6 < params < 250e6
    assert memplan.largest_trainable(budget, networked=True)[0] <= params
    assert memplan.largest_trainable(2 * budget)[0] > 2 * params
    assert memplan.largest_trainable(memplan.OVERHEAD) is None
    longer = memplan.largest_trainable(budget, base=replace(RWKVConfig(), ctx_len=1024),
                                       batch=8)
    assert longer[0] < params  # activations take their share


@pytest.mark.processes  # ~2 s here
def test_the_prediction_is_within_15_percent_of_a_real_peak():
    from tests.bench.memory import run_node

    config = memplan.rwkv_shape(384)  # 6 x 384: 11.7M parameters, 3 steps at batch 1
    got = run_node(config, eval_windows=4)
    predicted = memplan.rwkv_footprint(config).total
    assert got["checkpoints"] >= 1
    assert abs(predicted - got["peak"]) <= 0.15 * got["peak"], (predicted, got)


def test_hw_reports_what_a_4_and_an_8_gb_pi_can_train():
    """BENCHMARKS section 14: a 4 GB Pi trains ~180M parameters alone, an 8 GB one ~427M."""
    four = memplan.largest_here(4 * 10**9 * 0.93)  # what such a Pi reports as available
    eight = memplan.largest_here(8 * 10**9 * 0.93)
    assert 100e6 < four["alone"]["params"] < 250e6 < eight["alone"]["params"] < 500e6
    assert four["networked"]["params"] <= four["alone"]["params"]
    assert memplan.largest_here(0.5 * 2**30) == {"memory_budget_bytes": 0, "alone": None,
                                                 "networked": None, "lora": None}
    # LoRA r16 on a 16-bit base: a 4 GB Pi trains about a billion (section 15)
    assert 0.8e9 < four["lora"]["params"] < 1.6e9 < eight["lora"]["params"]
    assert "nothing fits" in memplan.describe_largest(memplan.largest_here(0))
    # LoRA mode keeps an average of the adapters by default: the estimate counts it (on an
    # 8 GB Pi that is one size of the family less)
    budget = 8 * 10**9 * 0.93 - memplan.OS_RESERVE
    counted = memplan.largest_trainable(budget, networked=True, lora_rank=16, ema=True)
    left_out = memplan.largest_trainable(budget, networked=True, lora_rank=16)
    assert eight["lora"]["params"] == counted[0] < left_out[0]


def test_an_average_of_the_weights_costs_four_bytes_a_parameter():
    from p2ptrain.memplan import footprint

    plain, averaged = footprint(10**6, 0), footprint(10**6, 0, ema=True)
    assert averaged.average == 4 * 10**6 == averaged.total - plain.total
