"""Issue 17's seed-regime scenarios: `base` inheritance of scenario files, runs that end at
the target (`stop_at_target`), the charged sizes of the seed's regime (100M full, the ~1B in
LoRA mode: batch 1 on the Pis, both fit a 4 GB Pi), and the table over several seeds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from sims import metrics, report, run
from sims.charge import ModelSize
from sims.scenario import ScenarioError, load, read

pytestmark = [pytest.mark.processes]


def test_base_scenario_is_inherited_and_overridden(tmp_path):
    fleet, lora = load("seed-fleet"), load("seed-1b-lora")
    assert lora.nodes == fleet.nodes and lora.sites == fleet.sites
    assert lora.model == fleet.model and lora.train["lr"] == fleet.train["lr"]
    assert lora.train["warmup_samples"] == 200 < fleet.train["warmup_samples"]  # replaced
    assert lora.charge["lora_rank"] == 16 and lora.stop_at_target and not fleet.stop_at_target
    assert [m.kind for m in lora.methods] == ["gossip"] * 8 + ["coordinator", "allreduce",
                                                                 "solo"]
    churn = load("seed-1b-lora-churn")
    assert churn.churn.failures and churn.charge == lora.charge
    # LoRA mode's default average of the weights, on every method, with and without churn
    from p2ptrain.learner import LORA_EMA
    from p2ptrain.proto.gossip.config import LORA_AVERAGE_FAST_SHARE

    for name in ("seed-1b-lora-ema", "seed-1b-lora-ema-churn"):
        ema = load(name)
        assert ema.train["ema"] == LORA_EMA and ema.charge == lora.charge
        assert {m.kind for m in ema.methods} == {"gossip", "coordinator", "allreduce", "solo"}
        assert ema.methods[0].name == "gossip, the default"
        assert ema.methods[0].params == {"average_fast_share": LORA_AVERAGE_FAST_SHARE}
        assert ema.churn.failures == (name.endswith("churn"))
    loop = tmp_path / "loop.toml"
    loop.write_text(f'base = "{loop}"\nname = "loop"\n')
    with pytest.raises(ScenarioError, match="cycle"):
        read(loop)
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")  # a traceback from `python -m sims run bad.toml`
    with pytest.raises(ScenarioError, match="not valid TOML"):
        read(bad)
    bad.write_bytes(b'name = "caf\xe9"\n')  # not UTF-8
    with pytest.raises(ScenarioError, match="not valid TOML"):
        read(bad)


def test_sims_seeds_of_a_directory_without_results_is_one_line(tmp_path, capsys):
    from sims.__main__ import main

    assert main(["seeds", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no readable results.json" in err and "Traceback" not in err
    (tmp_path / "results.json").write_text("[1, 2]")  # JSON, not a run's results
    assert main(["seeds", str(tmp_path)]) == 2
    assert "not a run's results" in capsys.readouterr().err


def test_seed_regime_sizes_fit_and_batches():
    fleet = load("seed-fleet")
    for name, batch_of_server in (("seed-100m", 2), ("seed-1b-lora", 1)):
        size = ModelSize.from_spec(load(name).charge)
        for device in ("rpi4", "laptop", "desktop", "server"):
            d = fleet.devices[device]
            assert d.holds(size.resident_bytes), (name, device)
            batch, _ = d.batch(size.flops_per_sample, size.activation_bytes)
            assert batch == (batch_of_server if device == "server" else 1), (name, device)
    full = ModelSize.from_spec({k: v for k, v in load("seed-1b-lora").charge.items()
                                if k != "lora_rank"})
    assert not fleet.devices["rpi4"].holds(full.resident_bytes)  # why LoRA: full 1B does not
    assert 99e6 < ModelSize.from_spec(load("seed-100m").charge).params < 101e6


def test_stop_at_target_ends_each_run_there():
    ci = load("ci").replace(stop_at_target=True, target_loss=4.0)
    for method in ci.methods[:1] + ci.methods[-1:]:  # gossip and one machine alone
        r = run.run_method(ci, method, 1)
        t = r["time_to_target"]
        assert t is not None and r["ended_at"] == t == r["simulated_seconds"]
        assert r["curve"][-1][0] == t and r["curve"][-1][5] <= ci.target_loss
        assert r["final_deliverable_loss"] <= ci.target_loss
        # the mean over replicas is kept beside the deliverable, and reaches no sooner
        mean_t = r["mean_time_to_target"]
        assert (mean_t is None and r["curve"][-1][1] > ci.target_loss) or mean_t == t


def test_gossip_time_to_target_is_the_leaders_replica():
    """Gossip's deliverable is the leader's replica (its checkpoints are what a user takes):
    the recorder's time to target follows it, and the mean over replicas is kept beside."""
    rec = metrics.Recorder("g", "gossip", {}, target=2.0)
    rec.point(0.0, [5.0, 5.0], None, 5.0)
    rec.point(10.0, [1.9, 3.0], 0.1, 1.9)  # the leader is there, the mean (2.45) is not
    rec.point(20.0, [1.8, 2.1], 0.1, 1.8)  # now the mean is too (1.95)
    rec.point(30.0, [1.7, 2.0], 0.1, None)  # no live leader: the mean stands in
    r = rec.result(None, 30.0)
    assert r["time_to_target"] == 10.0 and r["mean_time_to_target"] == 20.0
    assert r["final_deliverable_loss"] == 1.85 and r["final_loss"] == 1.85
    assert [p[5] for p in r["curve"]] == [5.0, 1.9, 1.8, 1.85]
    one = metrics.Recorder("solo", "solo", {}, target=2.0)
    one.point(5.0, [1.5])
    assert one.result(None, 5.0)["time_to_target"] == 5.0 == one.mean_reached_at


def _result(seed, rows):
    methods = [{"name": name, "kind": kind, "time_to_target": t, "simulated_seconds": 100.0,
                "curve": [[0.0, 5.0, 5.0, None, 0], [t or 100.0, 2.0, 2.0, None, samples]]}
               for name, kind, t, samples in rows]
    return {"scenario": "x", "seed": seed, "methods": methods,
            "fleet": {"charged_model": {"name": "m"}}}


def test_seeds_table_medians_and_ratios():
    runs = [_result(s, [("g", "gossip", tg, 400), ("c", "coordinator", tc, 300),
                        ("s", "solo", ts, 200)])
            for s, tg, tc, ts in ((1, 10.0, 30.0, 40.0), (2, 20.0, None, 40.0),
                                  (3, 30.0, None, 40.0))]
    lines = report.seeds_table(runs).splitlines()
    gossip = next(line for line in lines if "| g |" in line)
    assert "10 s / 20 s / 30 s (seeds 1, 2, 3)" in gossip
    assert "| 20 s | 400 | 2.00 | – |" in gossip  # the coordinator reached it once in three
    coord = next(line for line in lines if "| c |" in line)
    assert "not reached" in coord.split("|")[5]


def test_a_methods_lr_replaces_the_scenarios_for_it_alone():
    """`lr` in a method table: that method trains at its own learning rate (each method of the
    seed-regime tables at its best); the scenario's stays for the others."""
    ci = load("ci").replace(duration=4.0, stop_at_target=False)
    solo = next(m for m in ci.methods if m.kind == "solo")
    own = run.run_method(ci, solo, 1)
    same = run.run_method(ci, replace(solo, params={**solo.params, "lr": ci.train["lr"]}), 1)
    other = run.run_method(ci, replace(solo, params={**solo.params,
                                                     "lr": ci.train["lr"] * 4}), 1)
    assert same["curve"] == own["curve"] and same["params"]["lr"] == ci.train["lr"]
    assert other["curve"][-1][1] != own["curve"][-1][1]
    for bad in (0, 1.5, "fast", True):
        with pytest.raises(ValueError, match="lr must be"):
            run.run_method(ci, replace(solo, params={**solo.params, "lr": bad}), 1)
