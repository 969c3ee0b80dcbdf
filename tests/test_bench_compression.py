"""tests/bench/compression.py: configurations of a seed-regime scenario's gossip method, run a
short while, with bytes per trained sample against dense fp32 and the final loss."""

from __future__ import annotations

import pytest

from p2ptrain.proto import GossipConfig
from sims.gossip import check_shares
from sims.scenario import load
from tests.bench import compression

# as measured for BENCHMARKS §17: without the fast core's every-step exchanges (the default
# since 2026-12-03 late night), which would send 9.3% between the fastest after every step
TIERED = ("tiered:averaging=subset_int8,subset_fraction=0.093,subset_fraction_slow=0.0085,"
          "average_every_fast=0")
UNIFORM = "uniform:averaging=subset_int8,subset_fraction=0.093,average_every_fast=0"


def test_configurations_are_parsed_and_bad_ones_refused():
    assert compression.parse_config("default") == ("default", {})
    assert compression.parse_config("t:a=subset_int8,b=0.5,c=true") == (
        "t", {"a": "subset_int8", "b": 0.5, "c": True})
    for bad in ("", ":a=1", "t:a", "t:=1"):
        with pytest.raises(ValueError):
            compression.parse_config(bad)
    for bad in ("t:a", "t:no_such_knob=1",
                # the 30k proxy's 118 runs of 256: one run is 0.85%, not 0.1%
                "t:averaging=subset_int8,subset_fraction=0.09,subset_fraction_slow=0.001"):
        with pytest.raises(SystemExit) as refused:
            compression.main(["--config", bad])
        assert refused.value.code == 2


def test_the_simulator_refuses_a_share_its_proxy_cannot_stand_for():
    proxy = 30_176  # 118 runs of 256
    check_shares(GossipConfig(averaging="subset_int8", subset_fraction=0.093,
                              subset_fraction_slow=0.0085), proxy)  # 11 and 1 of 118
    for fraction, slow in ((0.09, 0.001), (0.01, 0.0), (0.09, 0.002)):
        with pytest.raises(ValueError, match="1/118 = 0.8475%"):
            check_shares(GossipConfig(averaging="subset_int8", subset_fraction=fraction,
                                      subset_fraction_slow=slow), proxy)


def test_pairs_of_slow_members_exchange_less_and_the_ratio_is_dense_fp32_over_bytes(capsys):
    """40 simulated seconds of the 1B-LoRA fleet: a 9.3% subset between the fastest members
    and 0.85% otherwise sends fewer bytes a sample than 9.3% for every pair, which sends fewer
    than every adapter; each ratio is 4 B x the 12.8M adapters x steps / samples over them."""
    rows = compression.main(["--seeds", "1", "--duration", "40", "--config", "default",
                             "--config", UNIFORM, "--config", TIERED])
    default, uniform, tiered = rows
    assert [r.config for r in rows] == ["default", "uniform", "tiered"]
    assert tiered.bytes_per_sample < 0.7 * uniform.bytes_per_sample
    assert uniform.bytes_per_sample < 0.3 * default.bytes_per_sample
    travelling = 12_800_000
    for r in rows:
        assert r.final > 0 and r.mean_final > 0 and r.seed == 1
        assert 0 < r.steps <= r.samples
        assert r.dense_ratio * r.bytes_per_sample == pytest.approx(
            4 * travelling * r.steps / r.samples, rel=3e-3)  # 12.78M exactly
    out = capsys.readouterr().out
    assert "tiered: final" in out and "against default" in out
    assert load("seed-1b-lora").charge["lora_rank"] == 16  # the adapters counted above
