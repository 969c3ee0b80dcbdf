"""Hardware detection: cores, memory, architecture, device class, matmul speed, batch size.

Container limits count: cgroup v2 `cpu.max` caps the usable cores and `memory.max` the
usable memory, so a node in a limited container sizes itself to its limits, not the host's.

The matmul speed is a robust figure: 16 runs spread over a second (each the fastest of a
short burst of matmuls), summarised by the median of the fastest half, so a neighbour busy
for part of the window does not count (one busy all of it can: the class floor below catches
that, and calibration.py keeps the first quiet figure for later starts). From that speed
and the model's FLOPs and activation memory, `explain_batch` picks the batch (and
gradient-accumulation steps) that fits memory and a target step time, never below the
device class's floor: a server ends near batch 128, a Raspberry Pi near 8.

The file-reading and timing live in `probe()`, `matmul_run()` and `detect()`; everything
else here is pure (the timing loop takes the timed run and the pause as arguments).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_BATCH = 128  # more samples per step stop paying off for these small models
MODEL_EFFICIENCY = 0.35  # fraction of matmul FLOP/s a training step reaches (see BENCHMARKS.md)
MEMORY_SHARE = 0.25  # share of usable memory that activations may take
MATMUL_SIZE = 512  # float32 (n x n) @ (n x n): what the matmul speed is measured on
TIMED_RUNS = 16  # runs of the robust speed figure
WINDOW_SECONDS = 1.0  # the runs are spread over this window (pauses between them)
BURST = 5  # one run is the fastest of this many back-to-back matmuls

# The floor of each device class: float32 matmul GFLOP/s per usable core that the slowest
# machine of the class still reaches when nothing else runs. A measured speed below
# floor x cores is someone else's load, not the machine, so the batch is never chosen from
# less. The default rwkv takes 346 MFLOP per sample (5.41 MFLOP/token x 64 tokens); at the
# 0.25 s target step and 35% of the matmul speed, 1 GFLOP/s is 0.253 samples per step, so:
#   rpi      2 /core: a Pi 3's Cortex-A53 at 1.2 GHz (a Pi 4 measures 25 in all, ~6/core);
#            4 cores: 8 GFLOP/s -> 2.0 samples -> batch 2 (a quiet Pi 4: 8)
#   laptop  10 /core: a low-power core at base clock on battery;
#            4 cores: 40 -> 10.1 -> batch 8; 8 cores: 80 -> 20 -> 16 (a 150 GFLOP/s laptop: 32)
#   desktop 20 /core: an SSE-only core at 2.5 GHz peaks at 20; any AVX core does twice that;
#            2 cores: 40 -> batch 8; 8 cores: 160 -> 40 -> 32 (a 250 GFLOP/s desktop: 64)
#   server  20 /core: desktop cores, often at lower clocks, SMT siblings counted as cores;
#            16 cores: 320 -> 81 -> 64; 32 cores: 640 -> 162 -> capped at 128
# A class outside the table (e.g. a simulator profile's own name) has no floor.
FLOOR_GFLOPS_PER_CORE = {"rpi": 2.0, "laptop": 10.0, "desktop": 20.0, "server": 20.0}


@dataclass(frozen=True)
class Hardware:
    arch: str  # machine architecture, e.g. x86_64, aarch64
    cpus: float  # usable cores (affinity and cgroup quota)
    cpus_host: int  # cores the host shows
    memory_bytes: int  # usable memory (the smaller of available RAM and cgroup limit)
    cgroup_cpu_limit: float | None  # cores allowed by cpu.max, if limited
    cgroup_memory_limit: int | None  # bytes allowed by memory.max, if limited
    matmul_gflops: float  # float32 matmul speed (robust figure), all usable threads
    has_battery: bool  # a laptop, most likely
    device_class: str  # rpi, laptop, desktop or server

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Machine:
    """What the system's files say about this machine: everything but its speed."""

    arch: str  # machine architecture
    cpus: float  # usable cores (affinity and cgroup quota)
    cpus_host: int  # cores the host shows
    memory_bytes: int  # usable memory
    cgroup_cpu_limit: float | None  # cores allowed by cpu.max, if limited
    cgroup_memory_limit: int | None  # bytes allowed by memory.max, if limited
    has_battery: bool  # a laptop, most likely

    def with_speed(self, gflops: float) -> Hardware:
        return Hardware(self.arch, self.cpus, self.cpus_host, self.memory_bytes,
                        self.cgroup_cpu_limit, self.cgroup_memory_limit, gflops,
                        self.has_battery, classify(self.arch, self.cpus, self.memory_bytes,
                                                   gflops, self.has_battery))


@dataclass(frozen=True, slots=True)
class MatmulTiming:
    """Timed matmul runs, summarised."""

    gflops: float  # the robust figure: median of the fastest half of the runs
    runs: int  # runs timed
    fastest: float  # GFLOP/s of the fastest run
    slowest: float  # GFLOP/s of the slowest run
    slowed: int  # runs under half the robust figure: something else had the cores

    def as_dict(self) -> dict:
        return asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2 cpu.max is "QUOTA PERIOD" or "max PERIOD"; returns cores or None."""
    if not text:
        return None
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if period > 0 else None


def parse_memory_max(text: str | None) -> int | None:
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _cgroup_dir() -> Path:
    """This process's cgroup v2 directory (the unified hierarchy's "0::/path" line)."""
    own = _read(Path("/proc/self/cgroup")) or ""
    for line in own.splitlines():
        if line.startswith("0::"):
            candidate = CGROUP_ROOT / line[3:].lstrip("/")
            if candidate.is_dir():
                return candidate
    return CGROUP_ROOT


def _meminfo_available() -> int:
    text = _read(Path("/proc/meminfo")) or ""
    fields = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value:
            fields[name] = int(value[0]) * 1024
    if "MemAvailable" in fields:
        return fields["MemAvailable"]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 30


def classify(arch: str, cpus: float, memory_bytes: int, gflops: float, battery: bool) -> str:
    """A coarse device class, for hints, scheduling weights and the simulator's profiles."""
    gib = memory_bytes / 2**30
    if arch in ("aarch64", "arm64", "armv7l") and cpus <= 4 and gib <= 8.5:
        return "rpi"
    if battery:
        return "laptop"
    if cpus >= 16 or (cpus >= 8 and gib >= 48) or gflops >= 400:
        return "server"
    return "desktop"


def probe(cgroup_dir: Path | None = None) -> Machine:
    """Read this machine (or container: `cgroup_dir` defaults to this process's cgroup)."""
    cg = cgroup_dir if cgroup_dir is not None else _cgroup_dir()
    cpu_limit = parse_cpu_max(_read(cg / "cpu.max"))
    mem_limit = parse_memory_max(_read(cg / "memory.max"))
    host = os.cpu_count() or 1
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = host
    cpus = float(min(affinity, cpu_limit)) if cpu_limit else float(affinity)
    memory = _meminfo_available()
    if mem_limit is not None:
        usage = parse_memory_max(_read(cg / "memory.current")) or 0
        memory = min(memory, max(mem_limit - usage, 0))
    battery = any(Path("/sys/class/power_supply").glob("BAT*"))
    return Machine(platform.machine(), cpus, host, memory, cpu_limit, mem_limit, battery)


def fastest_half(runs: int) -> int:
    """How many runs the robust figure takes the median of (the odd middle run included)."""
    return (runs + 1) // 2


def robust_timing(run_gflops: Sequence[float]) -> MatmulTiming:
    """The median of the fastest half of the runs: slow runs (a neighbour's load) drop out
    as long as they are fewer than half; a freak fast run moves the figure by one rank."""
    if not run_gflops:
        raise ValueError("no timed runs")
    ranked = sorted(run_gflops, reverse=True)
    figure = statistics.median(ranked[: fastest_half(len(ranked))])
    slowed = sum(1 for g in ranked if g < figure / 2)
    return MatmulTiming(figure, len(ranked), ranked[0], ranked[-1], slowed)


def time_matmul(run: Callable[[], float], runs: int = TIMED_RUNS,
                window_seconds: float = WINDOW_SECONDS,
                pause: Callable[[float], None] = time.sleep) -> MatmulTiming:
    """`runs` calls of `run` (one timed run, returning its GFLOP/s), one every
    window_seconds / runs (a pause between them), summarised by `robust_timing`."""
    speeds = []
    for k in range(runs):
        if k:
            pause(window_seconds / runs)
        speeds.append(run())
    return robust_timing(speeds)


def matmul_run(size: int = MATMUL_SIZE, burst: int = BURST,
               clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """A timed run for `time_matmul`: the GFLOP/s of the fastest of `burst` float32
    (size x size) matmuls back to back, at numpy's default thread count (all usable cores).
    A short burst right after a pause finds the cores free whenever a neighbour lets them be
    (the scheduler favours a thread that slept); runs of many matmuls timed together did not
    (BENCHMARKS.md, issue 15)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty((size, size), dtype=np.float32)
    np.matmul(a, b, out=out)  # warm-up: thread pool start, caches
    flops = 2.0 * size**3

    def run() -> float:
        best = float("inf")
        for _ in range(burst):
            start = clock()
            np.matmul(a, b, out=out)
            best = min(best, clock() - start)
        return flops / max(best, 1e-9) / 1e9

    return run


def matmul_gflops(size: int = MATMUL_SIZE, seconds: float = 0.3) -> float:
    """The fastest of back-to-back float32 (size x size) matmuls for `seconds` (at least 3),
    in GFLOP/s: the peak `p2ptrain bench` sets the model's speed against."""
    run = matmul_run(size, burst=1)
    best, runs, deadline = 0.0, 0, time.perf_counter() + seconds
    while runs < 3 or time.perf_counter() < deadline:
        best, runs = max(best, run()), runs + 1
    return best


def detect(bench_seconds: float = WINDOW_SECONDS, cgroup_dir: Path | None = None) -> Hardware:
    """Measure this machine now (calibration.py keeps the figure across starts)."""
    timing = time_matmul(matmul_run(), window_seconds=bench_seconds)
    return probe(cgroup_dir).with_speed(timing.gflops)


@dataclass(frozen=True, slots=True)
class BatchChoice:
    """The automatic batch and why: the inputs that decided it, and what each decided."""

    batch: int  # samples per step
    accum: int  # micro-batches per step (activations of batch/accum samples fit memory)
    target_step_seconds: float  # the step time aimed at
    samples_per_second: float  # estimated training speed at the measured matmul speed
    measured_batch: int  # the batch that speed alone gives (power of two, capped)
    floor: int  # the device class's floor for this model (1: the class has none)
    floor_gflops: float  # the matmul speed the floor stands for (0: no floor)
    fits: int  # samples whose activations fit the memory share
    device_class: str  # whose floor
    gflops: float  # the matmul speed the estimate came from
    flops_per_sample: float  # training FLOPs of one sample
    activation_bytes_per_sample: int  # activation memory of one sample

    @property
    def floor_applied(self) -> bool:
        return self.floor > self.measured_batch

    def as_dict(self) -> dict:
        return {**asdict(self), "floor_applied": self.floor_applied}

    def explain(self) -> list[str]:
        """Why this batch, one reason a line."""
        rounding = (f"capped at {MAX_BATCH}" if self.measured_batch == MAX_BATCH
                    else "the nearest power of two")
        lines = [f"a {self.target_step_seconds:g} s step at {self.samples_per_second:,.1f} "
                 f"samples/s ({MODEL_EFFICIENCY:.0%} of {self.gflops:.1f} GFLOP/s, "
                 f"{self.flops_per_sample / 1e6:,.0f} MFLOP/sample) takes "
                 f"{self.samples_per_second * self.target_step_seconds:,.1f} samples"
                 f" -> {self.measured_batch} ({rounding})"]
        if not self.floor_gflops:
            lines.append(f"no floor for device class {self.device_class}")
        else:
            floor = (f"{self.device_class} floor {self.floor} (the batch at "
                     f"{self.floor_gflops:g} GFLOP/s, the class's slowest for these cores)")
            lines.append(f"{floor}: applied, the measured speed gave only "
                         f"{self.measured_batch}" if self.floor_applied else
                         f"{floor}: not needed")
        per = f"{self.activation_bytes_per_sample / 2**20:.1f} MiB of activations per sample"
        lines.append(f"{per}, {self.fits:,} fit in {MEMORY_SHARE:.0%} of usable memory: " + (
            f"{self.accum} micro-batches of {self.batch // self.accum}" if self.accum > 1
            else "one micro-batch"))
        return lines


def class_floor_gflops(hw: Hardware) -> float:
    """The matmul speed the slowest machine of this class reaches on these cores (0: the
    class has no floor). A measured speed below it is someone else's load."""
    return FLOOR_GFLOPS_PER_CORE.get(hw.device_class, 0.0) * hw.cpus


def _batch_for(gflops: float, flops_per_sample: float, target_step_seconds: float) -> int:
    """The power of two nearest (in ratio) to the samples a step of the target time takes at
    `gflops` matmul speed, between 1 and MAX_BATCH."""
    samples = gflops * 1e9 * MODEL_EFFICIENCY / max(flops_per_sample, 1.0) * target_step_seconds
    return 1 << round(math.log2(min(float(MAX_BATCH), max(1.0, samples))))


def explain_batch(hw: Hardware, flops_per_sample: float, activation_bytes_per_sample: int,
                  target_step_seconds: float) -> BatchChoice:
    """The batch a step of the target time takes at the measured speed, raised to the device
    class's floor, split into micro-batches whose activations fit the memory share."""
    measured = _batch_for(hw.matmul_gflops, flops_per_sample, target_step_seconds)
    floor_gflops = class_floor_gflops(hw)
    floor = _batch_for(floor_gflops, flops_per_sample, target_step_seconds) if floor_gflops else 1
    batch = max(measured, floor)
    fits = max(1, int(hw.memory_bytes * MEMORY_SHARE // max(activation_bytes_per_sample, 1)))
    accum = 1
    while batch // accum > fits and accum < batch:
        accum *= 2
    speed = hw.matmul_gflops * 1e9 * MODEL_EFFICIENCY / max(flops_per_sample, 1.0)
    return BatchChoice(batch, accum, target_step_seconds, speed, measured, floor, floor_gflops,
                       fits, hw.device_class, hw.matmul_gflops, flops_per_sample,
                       activation_bytes_per_sample)


def choose_batch(hw: Hardware, flops_per_sample: float, activation_bytes_per_sample: int,
                 target_step_seconds: float) -> tuple[int, int]:
    """(batch, accumulation steps) of `explain_batch`."""
    choice = explain_batch(hw, flops_per_sample, activation_bytes_per_sample,
                           target_step_seconds)
    return choice.batch, choice.accum
