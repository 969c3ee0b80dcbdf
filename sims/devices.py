"""Device profiles: how fast a machine computes, what it holds, how it attaches, how it fails.

A `Device` is the simulator's picture of one class of machine (`rpi4`, `laptop`, `desktop`,
`server`): float32 matmul speed (what `p2ptrain bench` and the hardware detection measure),
the fraction of it a training step reaches, memory, NIC rates for WiFi and for Ethernet, and
mean times to failure and to return. From these and a model's FLOPs it derives

- the batch the hardware detection would choose (`p2ptrain.hw.choose_batch`, the same code
  the runtime runs, fed a synthetic `Hardware` record), and
- the time of one step: batch x FLOPs per sample / (matmul FLOP/s x efficiency), times
  (1 + `overhead`, the host work beside the gradient: optimiser update, mixing, codecs, the
  event loop), times a seeded log-normal jitter.

Profiles are calibrated from real hardware with `calibrate(profile, bench_json)`, where the
JSON is `p2ptrain bench --json` output from the machine: its matmul GFLOP/s and its measured
model/matmul ratio replace the defaults. Default figures: FIELD-NOTES.md (Pi 4: HPL FP64 8-12
GFLOP/s, so ~25 float32; Gigabit Ethernet 941 Mbit/s; Pi 4 WiFi ~100 Mbit/s) and our 2-core
VM (127 GFLOP/s float32 matmul, model ratio 0.35). Pure: no clock, no I/O but `load_bench`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from p2ptrain import hw

GIB = 2**30
# weights, gradient, Adam m and v, error-feedback residual, pending: a bound -- full training
# measured ~16.5 B/param at peak, and DESIGN.md's target is 18
BYTES_PER_PARAM_TRAINING = 24
MBIT = 1e6 / 8  # bytes/s in one Mbit/s


@dataclass(frozen=True, slots=True)
class Device:
    """One class of machine."""

    name: str  # profile name, also the member's device_class
    matmul_gflops: float  # float32 matmul speed, all cores (p2ptrain bench's matmul_gflops)
    efficiency: float = hw.MODEL_EFFICIENCY  # share of matmul speed a training step reaches
    memory_gib: float = 4.0  # usable memory
    cpus: int = 4  # cores (for the Hardware record the batch choice sees)
    arch: str = "x86_64"  # machine architecture
    battery: bool = False  # a laptop
    wifi_mbps: float = 100.0  # effective WiFi station rate (throughput, not the PHY rate)
    wired_mbps: float = 941.0  # effective Ethernet rate (TCP payload on Gigabit)
    mttf: float = 6 * 3600.0  # s; mean time to failure (exponential)
    mttr: float = 600.0  # s; mean time until a failed machine is back (exponential)
    jitter: float = 0.1  # sigma of the log-normal factor on each step's compute time
    # host work per step beside the gradient (optimiser update, mixing, codecs, the event
    # loop and HTTP), as a share of the gradient's time; 0: not charged. Calibration against
    # real nodes (tests/bench/calibrate.py) measured 0.2-0.3 for a 141k-parameter rwkv
    overhead: float = 0.0

    def __post_init__(self) -> None:
        positive = (self.matmul_gflops, self.efficiency, self.memory_gib, self.cpus,
                    self.wifi_mbps, self.wired_mbps, self.mttf, self.mttr)
        if not all(isinstance(v, int | float) and v > 0 and math.isfinite(v) for v in positive):
            raise ValueError(f"device {self.name}: every rate, size and time must be > 0")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"device {self.name}: jitter must be in [0, 1)")
        if not (isinstance(self.overhead, int | float) and 0 <= self.overhead < 100):
            raise ValueError(f"device {self.name}: overhead must be in [0, 100)")

    @property
    def flops(self) -> float:
        """FLOP/s a training step reaches."""
        return self.matmul_gflops * 1e9 * self.efficiency

    @property
    def capability(self) -> float:
        """The capability score members advertise (election ties): matmul GFLOP/s."""
        return round(self.matmul_gflops, 3)

    def hardware(self) -> hw.Hardware:
        """The record `p2ptrain.hw.detect()` would return on this machine."""
        memory = int(self.memory_gib * GIB)
        return hw.Hardware(self.arch, float(self.cpus), self.cpus, memory, None, None,
                           self.matmul_gflops, self.battery, self.name)

    def batch(self, flops_per_sample: float, activation_bytes: int,
              target_step_seconds: float = 0.25) -> tuple[int, int]:
        """(batch, accumulation steps) the hardware detection picks for this model."""
        return hw.choose_batch(self.hardware(), flops_per_sample, activation_bytes,
                               target_step_seconds)

    def step_seconds(self, batch: int, flops_per_sample: float,
                     rng: random.Random | None = None) -> float:
        """Time of one step of `batch` samples, the host work beside the gradient included
        (jittered when `rng` is given)."""
        base = batch * flops_per_sample / self.flops * (1.0 + self.overhead)
        if rng is None or self.jitter == 0:
            return base
        return base * math.exp(rng.gauss(0.0, self.jitter) - self.jitter**2 / 2)

    def fits(self, params: int) -> bool:
        """Whether fully training a model of `params` parameters fits in 80% of memory."""
        return self.holds(params * BYTES_PER_PARAM_TRAINING)

    def holds(self, nbytes: int) -> bool:
        """Whether `nbytes` of training state (ModelSize.resident_bytes) fit in 80% of
        memory."""
        return nbytes <= 0.8 * self.memory_gib * GIB

    def nic_bytes_per_second(self, medium: str) -> float:
        if medium == "wifi":
            return self.wifi_mbps * MBIT
        if medium == "wired":
            return self.wired_mbps * MBIT
        raise ValueError(f"unknown medium {medium!r} (wifi or wired)")

    def with_(self, **changes) -> Device:
        return dataclasses.replace(self, **changes)


PROFILES: dict[str, Device] = {
    "rpi4": Device("rpi4", matmul_gflops=25.0, memory_gib=4.0, cpus=4, arch="aarch64",
                   wifi_mbps=100.0, wired_mbps=941.0, mttf=6 * 3600.0, mttr=600.0),
    "laptop": Device("laptop", matmul_gflops=150.0, memory_gib=16.0, cpus=8, battery=True,
                     wifi_mbps=300.0, wired_mbps=941.0, mttf=2 * 3600.0, mttr=1800.0),
    "desktop": Device("desktop", matmul_gflops=250.0, memory_gib=16.0, cpus=8,
                      wifi_mbps=200.0, wired_mbps=941.0, mttf=12 * 3600.0, mttr=600.0),
    "server": Device("server", matmul_gflops=800.0, memory_gib=128.0, cpus=32,
                     wifi_mbps=300.0, wired_mbps=941.0, mttf=7 * 86400.0, mttr=3600.0),
}
"""Default profiles (override any field per scenario; calibrate from `p2ptrain bench`)."""


def calibrate(device: Device, bench: dict) -> Device:
    """The profile with speed measured on real hardware: `bench` is the JSON object that
    `p2ptrain bench --json` printed there (its `matmul_gflops` and `ratio`, the measured
    model/matmul efficiency, replace the profile's)."""
    try:
        gflops = float(bench["matmul_gflops"])
        ratio = float(bench.get("ratio", device.efficiency))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not p2ptrain bench --json output: {exc}") from None
    return device.with_(matmul_gflops=gflops, efficiency=ratio)


def load_bench(path: str | Path) -> dict:
    """Read one `p2ptrain bench --json` document."""
    return json.loads(Path(path).read_text())


def make_device(name: str, overrides: dict | None = None,
                base_dir: Path | None = None) -> Device:
    """A profile by name with scenario overrides; `bench = "file.json"` calibrates it."""
    overrides = dict(overrides or {})
    base = overrides.pop("profile", name)
    if base not in PROFILES:
        raise ValueError(f"unknown device profile {base!r}; known: {', '.join(PROFILES)}")
    device = PROFILES[base].with_(name=name)
    bench = overrides.pop("bench", None)
    if bench is not None:
        path = Path(bench) if base_dir is None else base_dir / bench
        device = calibrate(device, load_bench(path))
    fields = {f.name for f in dataclasses.fields(Device)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"device {name}: unknown fields {', '.join(unknown)}")
    return device.with_(**overrides)
