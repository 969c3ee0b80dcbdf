"""Hardware detection: cores, memory, architecture, device class, matmul speed, batch size.

Container limits count: cgroup v2 `cpu.max` caps the usable cores and `memory.max` the
usable memory, so a node in a limited container sizes itself to its limits, not the host's.
From the measured matmul speed and the model's FLOPs and activation memory, `choose_batch`
picks the batch (and gradient-accumulation steps) that fits memory and a target step time:
a server ends near batch 128, a Raspberry Pi near 8.

The file-reading and timing live in `detect()`; `choose_batch` and `classify` are pure.
"""

from __future__ import annotations

import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CGROUP_ROOT = Path("/sys/fs/cgroup")
MAX_BATCH = 128  # more samples per step stop paying off for these small models
MODEL_EFFICIENCY = 0.35  # fraction of matmul FLOP/s a training step reaches (see BENCHMARKS.md)
MEMORY_SHARE = 0.25  # share of usable memory that activations may take


@dataclass(frozen=True)
class Hardware:
    arch: str  # machine architecture, e.g. x86_64, aarch64
    cpus: float  # usable cores (affinity and cgroup quota)
    cpus_host: int  # cores the host shows
    memory_bytes: int  # usable memory (the smaller of available RAM and cgroup limit)
    cgroup_cpu_limit: float | None  # cores allowed by cpu.max, if limited
    cgroup_memory_limit: int | None  # bytes allowed by memory.max, if limited
    matmul_gflops: float  # float32 matmul speed measured now, all usable threads
    has_battery: bool  # a laptop, most likely
    device_class: str  # rpi, laptop, desktop or server

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


def matmul_gflops(size: int = 512, seconds: float = 0.3) -> float:
    """float32 (size x size) @ (size x size) speed at numpy's default thread count (all usable
    cores), best of repeated runs for `seconds`."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size), dtype=np.float32)
    b = rng.standard_normal((size, size), dtype=np.float32)
    out = np.empty((size, size), dtype=np.float32)
    flops = 2.0 * size**3
    best = float("inf")
    np.matmul(a, b, out=out)  # warm-up: thread pool start, caches
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 3 or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return flops / best / 1e9


def detect(bench_seconds: float = 0.3, cgroup_dir: Path | None = None) -> Hardware:
    """Measure this machine (or container: `cgroup_dir` defaults to this process's cgroup)."""
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
    arch = platform.machine()
    gflops = matmul_gflops(seconds=bench_seconds)
    return Hardware(arch, cpus, host, memory, cpu_limit, mem_limit, gflops, battery,
                    classify(arch, cpus, memory, gflops, battery))


def choose_batch(
    hw: Hardware,
    flops_per_sample: float,
    activation_bytes_per_sample: int,
    target_step_seconds: float,
) -> tuple[int, int]:
    """(batch, accumulation steps): the power of two nearest (in ratio) to the samples a step
    of the target time can take, split into micro-batches whose activations fit the memory
    share."""
    samples_per_second = hw.matmul_gflops * 1e9 * MODEL_EFFICIENCY / max(flops_per_sample, 1.0)
    want = min(float(MAX_BATCH), max(1.0, samples_per_second * target_step_seconds))
    batch = 1 << round(math.log2(want))
    fits = max(1, int(hw.memory_bytes * MEMORY_SHARE // max(activation_bytes_per_sample, 1)))
    accum = 1
    while batch // accum > fits and accum < batch:
        accum *= 2
    return batch, accum
