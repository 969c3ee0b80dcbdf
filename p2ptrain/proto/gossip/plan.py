"""Which coordinates a push-pull averaging exchange covers and how their values travel
(`averaging.py` runs the exchange). A subset exchange covers a seeded stratified choice of
runs of `block` consecutive coordinates; both sides derive it from the exchange's seed (carried
in every chunk's seed field) with the codecs' version-stable bit stream, so only values travel.
A plan with a `slow_fraction` covers that smaller share in an exchange whose seed's FAST_PAIR
bit is clear: the initiator sets the bit for a pair of the swarm's fastest members, and the
responder reads the share from the seed. Pure arithmetic: no I/O, no clock, no global random.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from p2ptrain.codecs import Codec, make_codec
from p2ptrain.codecs.kernels import BLOCK, bit_stream

# mode name -> (covers a subset, value type on the wire)
AVERAGING_MODES: dict[str, tuple[bool, str]] = {
    "full": (False, "fp32"),
    "fp16": (False, "fp16"),
    "subset": (True, "fp32"),
    "subset_fp16": (True, "fp16"),
    "int8": (False, "int8"),
    "subset_int8": (True, "int8"),
}
VALUE_CODECS = {"fp32": "none", "fp16": "fp16", "int8": "int8"}  # wire type -> codec name
FAST_PAIR = 1  # seed bit: the exchange covers `fraction`, not `slow_fraction`
SUBSET_BLOCK = 256  # coordinates per run of a subset: cheap gathers, few index entries
DEFAULT_PART = 1 << 21  # coordinates per part (8 MiB of fp32): a message of a few MB
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class AveragingPlan:
    """Which coordinates an exchange covers and how their values travel."""

    n: int  # length of the flat parameter vector
    fraction: float = 1.0  # share of coordinates one exchange covers; 1.0 = all
    values: str = "fp32"  # wire type of the values: "fp32", "fp16" or "int8"
    block: int = SUBSET_BLOCK  # a subset is made of runs of this many coordinates
    part: int = DEFAULT_PART  # coordinates per part: an exchange travels as independent parts
    slow_fraction: float | None = None  # share when the seed's FAST_PAIR bit is clear; None:
    #                                     `fraction` whatever the seed

    def __post_init__(self) -> None:
        if (self.n < 1 or self.block < 1 or not 0.0 < self.fraction <= 1.0
                or self.part < 1 or not (self.slow_fraction is None
                                         or 0.0 < self.slow_fraction <= self.fraction)):
            raise ValueError(f"bad averaging plan: n={self.n}, block={self.block}, "
                             f"fraction={self.fraction}, slow_fraction={self.slow_fraction}, "
                             f"part={self.part}")
        if self.values not in VALUE_CODECS:
            raise ValueError(f"averaging values must be one of {', '.join(VALUE_CODECS)}, "
                             f"not {self.values!r}")

    @classmethod
    def from_mode(cls, n: int, mode: str, subset_fraction: float = 0.1,
                  part: int = DEFAULT_PART, slow_fraction: float | None = None
                  ) -> AveragingPlan:
        """The plan of an averaging mode; `slow_fraction` applies to the subset modes only."""
        if mode not in AVERAGING_MODES:
            raise ValueError(f"unknown averaging mode {mode!r}; known: "
                             f"{', '.join(AVERAGING_MODES)}")
        subset, values = AVERAGING_MODES[mode]
        if not subset:
            return cls(n, 1.0, values, part=part)
        return cls(n, subset_fraction, values, part=part, slow_fraction=slow_fraction)

    def codec(self) -> Codec:
        return make_codec(VALUE_CODECS[self.values])

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.block)

    @property
    def k_blocks(self) -> int:
        """Runs the widest exchange covers (n_blocks when it covers everything)."""
        return self._runs_for(self.fraction)

    def k_for(self, seed: int) -> int:
        """Runs the exchange `seed` covers: `slow_fraction`'s share unless its FAST_PAIR bit
        is set (or the plan has no slow share)."""
        if self.slow_fraction is None or seed & FAST_PAIR:
            return self.k_blocks
        return self._runs_for(self.slow_fraction)

    def _runs_for(self, fraction: float) -> int:
        if fraction >= 1.0:
            return self.n_blocks
        return min(self.n_blocks, max(1, round(fraction * self.n_blocks)))

    def wire_shape(self) -> str:
        """What two members must agree on for their exchanges to match (the layout aside):
        a configuration fingerprint field. Members whose plans differ would send parts the
        other refuses as the wrong length, and count as offenders, so they are refused as
        members instead, with this field named."""
        share = "all" if self.fraction >= 1.0 else repr(self.fraction)
        if self.slow_fraction is not None:
            share += f"/{self.slow_fraction!r}"
        # a part as long as the widest exchange or longer: every exchange is one part
        part = "whole" if self.part_size >= self.capacity else str(self.part_size)
        return f"{self.values} {share} runs {self.block} part {part}"

    @property
    def covers_all(self) -> bool:
        """Whether every exchange covers every coordinate."""
        return self.slow_fraction is None and self.k_blocks >= self.n_blocks

    @property
    def capacity(self) -> int:
        """Most coordinates one exchange covers (all its parts together)."""
        return self.n if self.covers_all else min(self.n, self.k_blocks * self.block)

    @property
    def part_size(self) -> int:
        """Coordinates of one part: `part` rounded up to whole runs of `block`."""
        return -(-self.part // self.block) * self.block

    @property
    def buffer_size(self) -> int:
        """The snapshot buffer's length: one part at most."""
        return min(self.capacity, self.part_size)

    def covered(self, seed: int) -> int:
        """Coordinates the exchange `seed` covers (all parts)."""
        runs = self.subset(seed)
        if runs is None:
            return self.n
        starts = runs.astype(np.int64) * self.block
        return int((np.minimum(starts + self.block, self.n) - starts).sum())

    def parts(self, seed: int) -> int:
        """How many parts the exchange `seed` travels as."""
        return max(1, -(-self.covered(seed) // self.part_size))

    def part_range(self, seed: int, part: int) -> tuple[int, int]:
        """[lo, hi) of part `part` within the exchange's covered coordinates."""
        m = self.covered(seed)
        lo = part * self.part_size
        if not 0 <= lo < max(m, 1):
            raise ValueError(f"part {part} out of range for {m} coordinates")
        return lo, min(m, lo + self.part_size)

    def split(self, runs: np.ndarray) -> tuple[np.ndarray, int]:
        """(indices of the whole runs, length of the partial last run if chosen, else 0)."""
        whole = self.n // self.block
        if runs.shape[0] and runs[-1] == whole:  # only exists when block does not divide n
            return runs[:-1], self.n - whole * self.block
        return runs, 0

    def scatter_add(self, params: np.ndarray, runs: np.ndarray | None, delta: np.ndarray,
                    lo: int) -> None:
        """params += delta at the coordinates a part covers: `runs` (its runs of a subset) or,
        for None, the contiguous range from `lo`."""
        if runs is None:
            params[lo : lo + delta.shape[0]] += delta
            return
        b = self.block
        whole, tail = self.split(runs)
        k = whole.shape[0]
        grid = params[: (self.n // b) * b].reshape(-1, b)
        rows = delta[: k * b].reshape(k, b)
        step = max(1, BLOCK // b)  # bounds the fancy-indexing temporaries to one sub-block
        for start in range(0, k, step):
            grid[whole[start : start + step]] += rows[start : start + step]
        if tail:
            params[self.n - tail :] += delta[k * b : k * b + tail]

    def subset(self, seed: int) -> np.ndarray | None:
        """Sorted indices of the runs the exchange with `seed` covers (None: everything).
        Stratified: run j is drawn from stratum [j*N//k, (j+1)*N//k) of the N runs, from the
        top 32 bits of the j-th raw draw of the codecs' stable bit stream."""
        k, nb = self.k_for(seed), self.n_blocks
        if k >= nb:
            return None
        bounds = (np.arange(k + 1, dtype=np.uint64) * np.uint64(nb)) // np.uint64(k)
        lengths = bounds[1:] - bounds[:-1]
        draws = bit_stream(seed & _MASK64).random_raw(k) >> np.uint64(32)
        return (bounds[:-1] + ((draws * lengths) >> np.uint64(32))).astype(np.intp)
