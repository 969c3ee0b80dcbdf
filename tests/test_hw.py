"""Hardware detection and the automatic batch: cgroup limits, device classes, the robust
matmul figure (fed injected run timings, never the clock), and the class floors."""

import pytest

from p2ptrain.hw import (
    FLOOR_GFLOPS_PER_CORE,
    MAX_BATCH,
    Hardware,
    choose_batch,
    classify,
    detect,
    explain_batch,
    parse_cpu_max,
    parse_memory_max,
    probe,
    robust_timing,
    time_matmul,
)

# the default rwkv: 5.41 MFLOP/token x 64 tokens per sample, 4.5 MB activations per sample
FLOPS, ACT, TARGET = 5.41e6 * 64, int(4.5 * 2**20), 0.25


def test_cgroup_files():
    assert parse_cpu_max("max 100000") is None
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cpu_max("garbage") is None and parse_cpu_max(None) is None
    assert parse_memory_max("max") is None and parse_memory_max("1073741824") == 2**30


def hw(arch, cpus, gib, gflops, battery=False):
    mem = int(gib * 2**30)
    return Hardware(arch, cpus, int(cpus), mem, None, None, gflops, battery,
                    classify(arch, cpus, mem, gflops, battery))


def test_device_classes():
    assert hw("aarch64", 4, 3.5, 12).device_class == "rpi"
    assert hw("x86_64", 8, 16, 150, battery=True).device_class == "laptop"
    assert hw("x86_64", 4, 16, 100).device_class == "desktop"
    assert hw("x86_64", 32, 128, 1500).device_class == "server"


def test_batch_follows_speed_and_memory():
    assert choose_batch(hw("x86_64", 32, 128, 1500), FLOPS, ACT, TARGET) == (128, 1)  # server
    assert choose_batch(hw("x86_64", 2, 23, 160), FLOPS, ACT, TARGET) == (32, 1)  # this VM
    assert choose_batch(hw("aarch64", 4, 3.5, 25), FLOPS, ACT, TARGET) == (8, 1)  # Pi 4
    assert choose_batch(hw("aarch64", 4, 3.5, 5), FLOPS, ACT, TARGET) == (2, 1)  # rpi floor
    batch, accum = choose_batch(hw("x86_64", 32, 0.2, 1500), FLOPS, ACT, TARGET)
    assert batch == 128 and accum > 1 and (batch // accum) * ACT <= 0.25 * 2**30


def test_class_floors_for_the_default_rwkv():
    """The table in hw.py's comment: floor GFLOP/s per core x cores -> batch."""
    floors = {(c, cpus): explain_batch(h, FLOPS, ACT, TARGET).floor
              for c, cpus, h in [("rpi", 4, hw("aarch64", 4, 3.5, 25)),
                                 ("laptop", 4, hw("x86_64", 4, 16, 150, True)),
                                 ("laptop", 8, hw("x86_64", 8, 16, 150, True)),
                                 ("desktop", 2, hw("x86_64", 2, 16, 150)),
                                 ("desktop", 8, hw("x86_64", 8, 16, 250)),
                                 ("server", 16, hw("x86_64", 16, 64, 800)),
                                 ("server", 32, hw("x86_64", 32, 128, 1500))]}
    assert floors == {("rpi", 4): 2, ("laptop", 4): 8, ("laptop", 8): 16, ("desktop", 2): 8,
                      ("desktop", 8): 32, ("server", 16): 64, ("server", 32): MAX_BATCH}
    # a floor never exceeds what the class's quiet reference machine gets (sims/devices.py)
    for h in (hw("aarch64", 4, 4, 25), hw("x86_64", 8, 16, 150, True),
              hw("x86_64", 8, 16, 250), hw("x86_64", 32, 128, 800)):
        choice = explain_batch(h, FLOPS, ACT, TARGET)
        assert not choice.floor_applied and choice.floor <= choice.batch


QUIET = [200.0 + 7 * (k % 5) for k in range(16)]  # GFLOP/s of 16 runs, a little jitter


def runs_of(speeds):
    """An injected timed run: each call returns the next run's GFLOP/s."""
    return iter(speeds).__next__


def test_robust_figure_ignores_slow_runs():
    quiet = robust_timing(QUIET)
    for slowed in ([g / 5 if k % 2 else g for k, g in enumerate(QUIET)],  # every other run
                   [g / 5 if k < 8 else g for k, g in enumerate(QUIET)],  # the first half
                   [g / 50 if k in (3, 9, 10) else g for k, g in enumerate(QUIET)]):
        busy = robust_timing(slowed)
        assert busy.gflops == pytest.approx(quiet.gflops, rel=0.05)  # within the jitter
        assert busy.slowest < quiet.slowest and busy.slowed >= 3
    assert quiet.slowed == 0 and quiet.runs == 16 and quiet.fastest == 228.0
    assert robust_timing([50.0]).gflops == 50.0
    with pytest.raises(ValueError):
        robust_timing([])


def test_time_matmul_spreads_runs_over_the_window_without_sleeping():
    pauses = []
    timing = time_matmul(runs_of(QUIET), runs=16, window_seconds=2.0, pause=pauses.append)
    assert pauses == [2.0 / 16] * 15 and timing == robust_timing(QUIET)


@pytest.mark.parametrize("machine", [
    hw("aarch64", 4, 3.5, 25), hw("x86_64", 8, 16, 150, battery=True),
    hw("x86_64", 2, 23, 160), hw("x86_64", 8, 16, 250), hw("x86_64", 32, 128, 800),
], ids=["rpi", "laptop", "this-vm", "desktop", "server"])
def test_a_busy_neighbour_never_takes_the_batch_below_the_floor(machine):
    quiet_speeds = [machine.matmul_gflops * g / 200 for g in QUIET]

    def batch_from(speeds):
        timing = time_matmul(runs_of(speeds), runs=len(speeds), pause=lambda s: None)
        h = hw(machine.arch, machine.cpus, machine.memory_bytes / 2**30, timing.gflops,
               machine.has_battery)
        return explain_batch(h, FLOPS, ACT, TARGET)

    quiet = batch_from(quiet_speeds)
    half_slow = batch_from([g / 5 if k % 2 else g for k, g in enumerate(quiet_speeds)])
    assert half_slow.batch == quiet.batch and not quiet.floor_applied
    for factor in (5, 50, 5000):  # every run slow: the class floor holds
        busy = batch_from([g / factor for g in quiet_speeds])
        assert busy.batch >= busy.floor > 1 and busy.batch <= quiet.batch
    crushed = batch_from([g / 5000 for g in quiet_speeds])
    assert crushed.floor_applied and crushed.batch == crushed.floor
    assert any("applied" in line for line in crushed.explain())


def test_no_floor_for_a_class_outside_the_table():
    h = Hardware("x86_64", 4.0, 4, 2**34, None, None, 1.0, False, "rpi4")  # a sims profile
    choice = explain_batch(h, FLOPS, ACT, TARGET)
    assert "rpi4" not in FLOOR_GFLOPS_PER_CORE
    assert choice.floor == 1 and choice.batch == 1 and not choice.floor_applied


def test_explanation_names_target_speed_floor_and_memory():
    choice = explain_batch(hw("x86_64", 32, 0.2, 1500), FLOPS, ACT, TARGET)
    text = "\n".join(choice.explain())
    assert "0.25 s step" in text and "samples/s" in text and "capped at 128" in text
    assert "server floor" in text and "not needed" in text
    assert f"{choice.accum} micro-batches of {128 // choice.accum}" in text
    assert choice.as_dict()["floor_applied"] is False


def test_probe_honours_cgroup_limits(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**28}\n")
    limited = probe(tmp_path)
    assert limited.cgroup_cpu_limit == 0.5 and limited.cpus == 0.5
    assert limited.cgroup_memory_limit == 2**30
    assert limited.memory_bytes == 2**30 - 2**28
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max\n")
    free = probe(tmp_path)
    assert free.cgroup_cpu_limit is None and free.cpus >= 1 and free.memory_bytes > 2**28


def test_detect_measures_this_machine(tmp_path):
    found = detect(bench_seconds=0.01, cgroup_dir=tmp_path)
    assert found.matmul_gflops > 0 and found.device_class in FLOOR_GFLOPS_PER_CORE
