"""The matmul calibration a node keeps in its state directory: `hw-calibration.json`.

The first start times the matmul (hw.time_matmul) and writes the figure with the facts it
depends on (architecture, usable cores, cgroup limits, CPU model, numpy and its BLAS, the
BLAS environment variables); later starts reuse it while every fact is the same and measure
again when one differs. No wall-clock time is stored or needed (a Pi has no RTC): a
calibration is current exactly as long as its facts are. A changed measurement method bumps
VERSION, which also measures again. Delete the file to measure again by hand.

One exception to "the first is kept": a measurement that shows other load (a quarter of the
runs under half the figure, or a figure under the class floor) is saved as unsettled, and the
next start measures again and keeps the faster of the two (load only ever slows a matmul),
until a quiet measurement settles it. A node that first started beside a busy neighbour
so recovers its speed at its next start instead of keeping the neighbour's mark for good.

The file is read bounded and checked strictly; one that is unreadable, too large, not JSON or
not exactly this format is ignored with a warning and replaced by a fresh measurement: it
never stops a node. This module measures and remembers; it never chooses a batch (hw.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from p2ptrain import __version__
from p2ptrain.fsutil import (
    NotRegularFile,
    TooLarge,
    atomic_write_bytes,
    describe_os_error,
    read_regular,
)
from p2ptrain.hw import (
    MATMUL_SIZE,
    Hardware,
    Machine,
    MatmulTiming,
    class_floor_gflops,
    fastest_half,
    matmul_run,
    probe,
    time_matmul,
)

CALIBRATION_FILE = "hw-calibration.json"
FORMAT = "p2ptrain-hw-calibration"
VERSION = 1  # bump when the measurement changes (size, runs, statistic)
MAX_FILE_BYTES = 16 * 1024  # a real file is ~600 bytes
MAX_TEXT = 200  # longest string field
BLAS_ENV_PREFIXES = ("OPENBLAS_", "OMP_", "MKL_", "BLIS_", "GOTO_")


class CalibrationError(ValueError):
    """A calibration file that is not exactly what this module writes."""


@dataclass(frozen=True, slots=True)
class Facts:
    """What the matmul speed depends on: a calibration is reused only when all are equal."""

    arch: str  # machine architecture
    cpus: float  # usable cores (affinity and cgroup quota)
    cpus_host: int  # cores the host shows
    cgroup_cpu_limit: float | None  # cores allowed by cpu.max, if limited
    cgroup_memory_limit: int | None  # bytes allowed by memory.max, if limited
    cpu_model: str  # /proc/cpuinfo's model line ("" where there is none)
    blas: str  # numpy's version and the BLAS it was built with
    blas_env: str  # BLAS and OpenMP environment variables set, e.g. "OPENBLAS_NUM_THREADS=1"


FACT_NAMES = {"arch": "architecture", "cpus": "usable cores", "cpus_host": "host cores",
              "cgroup_cpu_limit": "cgroup cpu.max", "cgroup_memory_limit": "cgroup memory.max",
              "cpu_model": "CPU model", "blas": "BLAS", "blas_env": "BLAS environment"}


@dataclass(frozen=True, slots=True)
class Calibrated:
    """This machine with its matmul speed, and where the speed came from."""

    hardware: Hardware  # the machine now, with the calibrated speed
    timing: MatmulTiming  # the runs behind the speed
    fresh: MatmulTiming | None  # this start's measurement (None: the file was reused)
    settled: bool  # a quiet measurement is behind it (else the next start measures again)
    path: Path | None  # the calibration file (None: no state directory given)
    why_measured: str  # why not reused ("" when reused)
    stored: str  # what became of a fresh measurement: "saved to ...", "not saved: ..."
    warnings: tuple[str, ...]  # a file ignored, a write that failed

    @property
    def source(self) -> str:
        return "calibration file" if self.fresh is None else "measured now"

    def as_dict(self) -> dict:
        return {**self.timing.as_dict(), "spread": self.timing.fastest / self.timing.slowest,
                "source": self.source, "path": str(self.path or ""),
                "settled": self.settled, "why_measured": self.why_measured,
                "fresh": self.fresh.as_dict() if self.fresh is not None else None,
                "stored": self.stored}

    def describe(self) -> list[str]:
        t = self.timing
        lines = [f"{t.gflops:.1f} GFLOP/s (float32 {MATMUL_SIZE}x{MATMUL_SIZE}): median of the "
                 f"fastest {fastest_half(t.runs)} of {t.runs} runs, which ranged "
                 f"{t.slowest:.1f}-{t.fastest:.1f}; {t.slowed} slowed by other load "
                 f"(under half the median)"]
        if self.fresh is None:
            lines.append(f"from {self.path}, measured at an earlier start on the same "
                         "hardware (delete it to measure again)")
        elif self.fresh is not t:
            lines.append(f"measured now ({self.why_measured}): {self.fresh.gflops:.1f} GFLOP/s, "
                         f"{self.fresh.slowed} of {self.fresh.runs} runs slowed; the earlier, "
                         f"faster figure kept, {self.stored}")
        else:
            lines.append(f"measured now ({self.why_measured}), {self.stored}")
        if not self.settled:
            lines.append("other load showed: the next start measures again and keeps the "
                         "faster figure")
        return lines


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", "rb") as f:
            text = f.read(1 << 16).decode("utf-8", "replace")
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("model name", "Model", "Hardware", "cpu model"):
            return value.strip()[:MAX_TEXT]
    return ""


def _blas() -> str:
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return f"numpy {np.__version__}, {blas['name']} {blas['version']}"[:MAX_TEXT]
    except (AttributeError, KeyError, TypeError, ValueError):
        return f"numpy {np.__version__}"


def facts_of(machine: Machine, environ: Mapping[str, str] = os.environ) -> Facts:
    blas_env = " ".join(f"{k}={v}" for k, v in sorted(environ.items())
                        if k.startswith(BLAS_ENV_PREFIXES))
    return Facts(machine.arch, machine.cpus, machine.cpus_host, machine.cgroup_cpu_limit,
                 machine.cgroup_memory_limit, _cpu_model(), _blas(), blas_env[:MAX_TEXT])


def differences(old: Facts, new: Facts) -> list[str]:
    """What changed, e.g. ["usable cores 4.0 -> 2.0"]."""
    return [f"{FACT_NAMES[f.name]} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
            for f in fields(Facts) if getattr(old, f.name) != getattr(new, f.name)]


def disturbed(timing: MatmulTiming, machine: Machine) -> bool:
    """Whether other load may have lowered the figure: a quarter of the runs or more under
    half of it (a stray slow run or two only shows the statistic at work), or a figure under
    what the slowest machine of its class reaches on these cores."""
    floor = class_floor_gflops(machine.with_speed(timing.gflops))
    return timing.slowed * 4 >= timing.runs or timing.gflops < floor


def encode(facts: Facts, timing: MatmulTiming, settled: bool) -> bytes:
    doc = {"format": FORMAT, "version": VERSION, "by": f"p2ptrain {__version__}",
           "facts": asdict(facts), "matmul": timing.as_dict(), "settled": settled}
    return (json.dumps(doc, indent=1) + "\n").encode()


def _section(doc: object, key: str, names: set[str]) -> dict:
    part = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(part, dict) or set(part) != names:
        raise CalibrationError(f"'{key}' is not an object with exactly {sorted(names)}")
    return part


def _number(part: dict, key: str, integer: bool = False, optional: bool = False,
            low: float = 0.0, high: float = 1e15) -> float | int | None:
    v = part[key]
    if v is None and optional:
        return None
    kinds = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kinds) or not low <= v <= high:  # NaN fails
        raise CalibrationError(f"{key} = {str(v)[:40]} is out of range")
    return v if integer else float(v)


def _text(part: dict, key: str) -> str:
    v = part[key]
    if not isinstance(v, str) or len(v) > MAX_TEXT:
        raise CalibrationError(f"{key} is not a string of at most {MAX_TEXT} characters")
    return v


def parse(data: bytes) -> tuple[Facts, MatmulTiming, bool]:
    """The facts, timing and settledness of a calibration file's bytes; CalibrationError
    otherwise."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting bombs
        raise CalibrationError(f"not JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CalibrationError("not a p2ptrain calibration")
    if set(doc) != {"format", "version", "by", "facts", "matmul", "settled"}:
        raise CalibrationError(f"unexpected fields {sorted(map(str, doc))[:8]}")
    if doc["version"] != VERSION:
        raise CalibrationError(f"version {str(doc['version'])[:20]}, this p2ptrain writes "
                               f"{VERSION}")
    _text(doc, "by")
    if not isinstance(doc["settled"], bool):
        raise CalibrationError("settled is not true or false")
    f = _section(doc, "facts", {x.name for x in fields(Facts)})
    facts = Facts(_text(f, "arch"), _number(f, "cpus", high=1e6),
                  _number(f, "cpus_host", integer=True, low=1, high=1e6),
                  _number(f, "cgroup_cpu_limit", optional=True, high=1e6),
                  _number(f, "cgroup_memory_limit", integer=True, optional=True, high=2**64),
                  _text(f, "cpu_model"), _text(f, "blas"), _text(f, "blas_env"))
    m = _section(doc, "matmul", {x.name for x in fields(MatmulTiming)})
    timing = MatmulTiming(_number(m, "gflops", low=1e-6, high=1e7),
                          _number(m, "runs", integer=True, low=1, high=10_000),
                          _number(m, "fastest", low=1e-6, high=1e7),
                          _number(m, "slowest", low=1e-6, high=1e7),
                          _number(m, "slowed", integer=True, high=10_000))
    if not timing.slowest <= timing.gflops <= timing.fastest or timing.slowed >= timing.runs:
        raise CalibrationError("the runs contradict the figure")
    return facts, timing, doc["settled"]


def read(path: Path) -> bytes | None:
    """The file's bytes (None when absent): a regular file of at most MAX_FILE_BYTES, opened
    without blocking (a FIFO planted there cannot hang the start)."""
    try:
        return read_regular(path, MAX_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CalibrationError(f"cannot read it: {describe_os_error(exc)}") from None
    except (NotRegularFile, TooLarge) as exc:
        raise CalibrationError(str(exc)) from None


def measure_now() -> MatmulTiming:
    return time_matmul(matmul_run())


def calibrate(state_dir: Path | None, machine: Machine | None = None,
              measure: Callable[[], MatmulTiming] = measure_now,
              environ: Mapping[str, str] = os.environ) -> Calibrated:
    """This machine with the speed from `<state_dir>/hw-calibration.json` when that is
    settled and its facts are this machine's, else measured now and written there (if the
    directory exists)."""
    machine = machine if machine is not None else probe()
    facts = facts_of(machine, environ)
    path = Path(state_dir) / CALIBRATION_FILE if state_dir is not None else None
    warnings: list[str] = []
    earlier: MatmulTiming | None = None  # an unsettled figure of these facts
    why = "no state directory"
    if path is not None:
        why = "no calibration yet"
        try:
            data = read(path)
            if data is not None:
                old_facts, old_timing, settled = parse(data)
                changed = differences(old_facts, facts)
                if not changed and settled:
                    return Calibrated(machine.with_speed(old_timing.gflops), old_timing, None,
                                      True, path, "", "", ())
                if changed:
                    why = "changed since the calibration: " + ", ".join(changed)
                else:
                    earlier = old_timing
                    why = "the earlier measurement showed other load"
        except CalibrationError as exc:
            warnings.append(f"ignoring {path}: {exc}; measuring the matmul speed again")
            why = "calibration file ignored"
    fresh = measure()
    settled = not disturbed(fresh, machine)
    timing = earlier if earlier is not None and earlier.gflops > fresh.gflops else fresh
    stored = "not saved: no state directory"
    if path is not None and not path.parent.is_dir():
        stored = f"not saved: {path.parent} does not exist yet (a node's first start makes it)"
    elif path is not None:
        try:
            atomic_write_bytes(path, encode(facts, timing, settled))
            stored = f"saved to {path}"
        except OSError as exc:
            stored = "not saved"
            warnings.append(f"cannot save the matmul calibration: {describe_os_error(exc)}")
    return Calibrated(machine.with_speed(timing.gflops), timing, fresh, settled, path, why,
                      stored, tuple(warnings))
