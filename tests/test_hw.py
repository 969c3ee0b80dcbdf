from p2ptrain.hw import (
    Hardware,
    choose_batch,
    classify,
    detect,
    parse_cpu_max,
    parse_memory_max,
)


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
    # the default rwkv: 5.4 MFLOP/token x 64 tokens per sample, 4.5 MB activations per sample
    flops, act = 5.41e6 * 64, int(4.5 * 2**20)
    assert choose_batch(hw("x86_64", 32, 128, 1500), flops, act, 0.25) == (128, 1)  # server
    assert choose_batch(hw("x86_64", 2, 23, 160), flops, act, 0.25) == (32, 1)  # this VM
    assert choose_batch(hw("aarch64", 4, 3.5, 25), flops, act, 0.25) == (8, 1)  # Pi 4
    assert choose_batch(hw("aarch64", 4, 3.5, 5), flops, act, 0.25) == (1, 1)  # a weak Pi
    batch, accum = choose_batch(hw("x86_64", 32, 0.2, 1500), flops, act, 0.25)
    assert batch == 128 and accum > 1 and (batch // accum) * act <= 0.25 * 2**30


def test_detect_honours_cgroup_limits(tmp_path):
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**28}\n")
    limited = detect(bench_seconds=0.01, cgroup_dir=tmp_path)
    assert limited.cgroup_cpu_limit == 0.5 and limited.cpus == 0.5
    assert limited.cgroup_memory_limit == 2**30
    assert limited.memory_bytes == 2**30 - 2**28
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.max").write_text("max\n")
    free = detect(bench_seconds=0.01, cgroup_dir=tmp_path)
    assert free.cgroup_cpu_limit is None and free.cpus >= 1 and free.memory_bytes > 2**28
