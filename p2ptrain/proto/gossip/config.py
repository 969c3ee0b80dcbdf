"""Every knob of gradient gossip and parameter averaging (`GossipConfig`): the `[gossip]`
section of a node's TOML, a simulator method's gossip knobs, and the schedule's formulas.

Each field declared with `option(...)` is a configuration option `gossip.<field>` with its
default and help line here and nowhere else (p2ptrain.config builds the option table from it).
Pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from p2ptrain.codecs import Codec, make_codec
from p2ptrain.options import option
from p2ptrain.proto.gossip.guard import DistanceGuard
from p2ptrain.proto.gossip.plan import AVERAGING_MODES, DEFAULT_PART, AveragingPlan

# `averaging = "auto"` (issue 17, BENCHMARKS §16): a model that computes this many FLOPs per
# sample for every coordinate of the vector that travels averages all of it. Full training
# computes ~6 x ctx_len per parameter (384 at the default rwkv's 64 tokens, 100M alike);
# rank-16 LoRA on the seed-1b base 19,470: there an exchange of every adapter in fp16 costs
# little next to a step, and the leader's replica reached the target 1.6x sooner than with a
# 10% subset (960 -> 600 s, medians of 3 seeds in the seed-1b-lora scenario). The values
# travel in int8 (a float32 scale per 256) since 2026-12-02 (§17): the same times to target
# and final losses as fp16 in ci, seed-default, seed-100m and seed-1b-lora, 1.5-1.7x fewer
# bytes.
AUTO = "auto"
AUTO_FULL_FLOPS = 2000.0


def flops_per_coordinate(model: Any, n: int) -> float:
    """FLOPs of one training sample (forward and backward) per coordinate of the flat vector
    of `n` that travels: what `averaging = "auto"` is decided by."""
    return float(model.flops_per_token()) * int(model.ctx_len) / max(int(n), 1)


# The fastest members average with each other after every step (`average_every_fast = 1`)
# while they are at most half the members a node could average with (`average_fast_share`):
# a fast core in a mixed fleet. BENCHMARKS §16, 2026-12-03 late night: at 100M that takes
# the fleet from level with one server to 1.27x it; with the default model it changed
# nothing but the bytes (1.5-1.6x the fleet's, most of it among the servers); on a LAN of
# similar machines, where every node is one of the fastest, it would be every step instead
# of every 5 for no measured gain, so there it stays off. LoRA mode (p2ptrain.config) takes
# it whatever the share: an exchange costs little next to a step there (auto above), and on
# the seed fleet it brought the leader's checkpoint to the target 1.11x sooner at 1B-LoRA.
LORA_AVERAGE_FAST_SHARE = 1.0

CODECS = ("none", "fp16", "bf16", "int8", "topk", "randomk", "qsgd", "sign")
FRACTION_CODECS = ("topk", "randomk")  # codecs that send a share of the coordinates


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """Every knob of gradient gossip and parameter averaging."""

    # Defaults chosen with the simulator (docs/BENCHMARKS.md §8, scenario `defaults`): pure
    # averaging of 10% of the coordinates every 5 steps (fp16 then, int8 now) reached first on
    # the seed fleet and under churn, on every seed, with the least traffic. Averaging is
    # weighted by sample rates since issue 17 (§16: the seed regime, where a Pi's step
    # takes 30x a server's, the leader's replica reaches the target twice as fast).
    codec: str = option("topk", "gradient codec (when gossip.fanout > 0)", choices=CODECS)
    fraction: float = option(0.01, "share of coordinates topk/randomk send", minimum=0)
    fanout: int = option(0, "peers each gradient is pushed to; 0 (the default, best in the "
                         "simulator): parameter averaging only", minimum=0)
    average_every: int = option(5, "local steps between parameter averagings; 0: never",
                                minimum=0)
    average_every_fast: int = option(
        1, "local steps between parameter averagings with one of the swarm's fastest members "
        "(a sample rate at least half the fastest observed), besides average_every's with "
        "any: on a node that is one of them, while they are at most average_fast_share of "
        "the members (replicas of a fast core kept close); 0: off, as it is while "
        "average_every is 0", minimum=0)
    average_fast_share: float = option(
        0.5, "average_every_fast's exchanges only while the swarm's fastest members (this "
        "node among them) are at most this share of the members it could average with "
        "(alive, accepting connections) and itself: a fast core in a mixed fleet, not every "
        "node of a LAN of similar machines; 1: whatever their share. Unset: 1 in LoRA mode",
        minimum=0)
    averaging: str = option(AUTO, "averaging exchange: all coordinates or a seeded subset, "
                            "in fp32, fp16 or int8 (a scale per 256 values); auto: all "
                            "coordinates in int8 (`int8`) when the model computes at least "
                            f"{AUTO_FULL_FLOPS:,.0f} FLOPs per sample for each coordinate "
                            "that travels (LoRA on a big frozen base), else `subset_int8`",
                            choices=(AUTO, *AVERAGING_MODES))
    subset_fraction: float = option(0.1, "share of coordinates a subset averaging exchange "
                                    "covers", minimum=0)
    subset_fraction_slow: float = option(
        0.0, "share a subset averaging exchange covers unless both sides are among the "
        "swarm's fastest (a sample rate at least half the fastest observed): the fastest keep "
        "their replicas close, the rest follow them for fewer bytes; 0: subset_fraction for "
        "every exchange", minimum=0)
    average_part: int = option(DEFAULT_PART, "coordinates per averaging message: a big "
                               "model's exchange travels as parts of this size", minimum=1024)
    average_pull_max: float = option(
        0.99, "how far a replica moves toward a peer's in an averaging exchange, at most: 0.5 "
        "is plain pairwise averaging; above, each side moves by the peer's share of the "
        "pair's observed sample rates (a slow replica follows a fast one), clamped to "
        "[1 - this, this]", minimum=0.5)
    average_pull_power: float = option(
        3.0, "the sample rates of average_pull_max's shares are raised to this power first: "
        "above 1 a faster replica moves less toward a slower one (which holds fewer recent "
        "steps) and the slower one follows it further; 1: the rates themselves", minimum=1)
    average_explore: float = option(
        0.01, "averaging partners are drawn by link speed and sample rate, each eligible peer "
        "weighted at least this times the mean weight (exploration): an exchange with a slow "
        "peer holds the node's one averaging exchange for its whole length", minimum=0)
    average_draw_power: float = option(
        3.0, "averaging partners are drawn by link speed times their sample rate raised to "
        "this power: above 1 a node draws peers as fast as itself or faster far more often "
        "than slower ones, whose exchanges move it little (average_pull_power) and hold its "
        "one exchange as long; 1: the rates themselves", minimum=1)
    average_known_rates: bool = option(
        True, "averaging partners are only peers whose sample rate this node has observed "
        "(their progress watched for 2 s): one that has shown none has no steps of its own "
        "to give, and at the start of a run a blind draw is mostly of slow peers; while no "
        "partner's rate is known, a due exchange is skipped")
    # 5 s: the 32,768 swarm samples this bound was before (issue 17) at the seed fleet's
    # ~6,700 samples/s; seconds hold across model sizes, where a count of samples does not
    # (at 1B parameters the same fleet makes a few samples per second)
    max_staleness_seconds: float = option(5.0, "peer gradients older than this many seconds "
                                          "of the swarm's sample rate are dropped (age is "
                                          "counted in swarm samples and converted with the "
                                          "samples/s this node measures; never less than two "
                                          "of its own steps; no bound before two steps)",
                                          minimum=0)
    max_staleness_samples: int = option(0, "deprecated (use gossip.max_staleness_seconds): "
                                        "when > 0, a fixed bound in swarm samples that "
                                        "replaces the one in seconds; 0: not set", minimum=0)
    error_feedback: bool = option(True, "keep a residual for biased codecs (topk, int8, "
                                  "randomk, sign)")
    clip_multiple: float = option(3.0, "peer gradients are clipped to this many times the "
                                  "median recent norm", minimum=0)
    norm_window: int = option(32, "the median norm is taken over the own gradient's last "
                              "this many norms and the latest of as many peers (one each)",
                              minimum=1)
    absurd_norm_multiple: float = option(1000.0, "peer gradients above this many times the "
                                         "median norm are refused", minimum=0)
    max_norm: float = option(1e6, "peer gradients above this norm are refused, whatever the "
                             "median", minimum=0)
    max_sample_weight: float = option(65536.0, "peer gradients claiming more samples than "
                                      "this are refused", minimum=0)
    distance_multiple: float = option(10.0, "averaging snapshots farther from this replica "
                                      "than this many times the median distance of recent "
                                      "applied exchanges are refused", minimum=1)
    distance_window: int = option(16, "recent applied averaging distances the median is "
                                  "taken over", minimum=1)
    min_distance: float = option(0.05, "averaging snapshots closer than this RMS distance "
                                 "are never refused (replicas drift apart fast early in a "
                                 "run, faster than a median follows)", minimum=0)
    max_distance: float = option(1.0, "averaging snapshots farther than this RMS distance "
                                 "are always refused (the only bound while no median holds)",
                                 minimum=0)
    distance_patience: int = option(3, "refused averaging snapshots in a row (of one peer, or "
                                    "of all) after which the absolute bound alone judges",
                                    minimum=1)
    average_timeout_margin: float = option(4.0, "an averaging part is given up after this "
                                           "many times its expected time: the round trip "
                                           "plus its bytes both ways over the bandwidth "
                                           "measured to the peer (never sooner than "
                                           "node.average_timeout, the only bound while "
                                           "nothing is measured)", minimum=1)
    average_timeout_max: float = option(600.0, "an averaging part is given up after this "
                                        "many seconds at most, whatever the measurements, "
                                        "and an exchange sends no further part after it "
                                        "has run this long: a slow or hostile peer holds "
                                        "the node's one exchange for twice this at most",
                                        minimum=1)
    outer_every: int = option(0, "local steps between outer steps (0: off): each node shares "
                              "its progress since the last one, compressed by the codec with "
                              "error feedback, with gossip.fanout peers, and moves by the "
                              "average of what it has (DiLoCo-style pseudo-gradients; no "
                              "per-step pushes then)", minimum=0)
    outer_lr: float = option(1.0, "outer learning rate: the step along the averaged progress",
                             minimum=0)
    outer_momentum: float = option(0.9, "decay of the error-feedback accumulator each outer "
                                   "step; it is the outer momentum (SparseLoCo); 0: plain "
                                   "error feedback", minimum=0)
    outer_rewind: bool = option(True, "at an outer step go back to where the round started "
                                "(SparseLoCo); false: keep the progress not yet sent (it "
                                "still travels later)")
    outer_feedback_bits: int = option(8, "bits a coordinate of the outer steps' error "
                                      "feedback is kept in: 8 (int8 with a scale per 256) or "
                                      "16 (bfloat16); both rounded stochastically", minimum=8)
    track_peers: int = option(
        0, "tracking (CHOCO-gossip, tracking.py): on a node that is one of the swarm's "
        "fastest, after every step push the scaled sign of its replica minus its public "
        "copy (1 bit a coordinate) to this many of the other fastest and move toward the "
        "copies it holds of theirs; 4 (k + 1) bytes a parameter of extra memory on such a "
        "node; 0: off", minimum=0)
    track_gamma: float = option(0.5, "tracking's step toward the mean of the copies held: "
                                "x += gamma / (m + 1) * sum(copy - own copy)", minimum=0)
    track_warmup: int = option(24, "pushes into an epoch before a copy (and the node's own) "
                               "is mixed: a copy starts at zero and closes on its replica "
                               "by about half a push", minimum=1)
    queue_vectors: int = option(16, "peer gradients waiting for the next mix, at most",
                                minimum=1)
    queue_bytes: int = option(256 << 20, "bytes of the peer gradients waiting, at most: "
                              "their payloads and 1 KiB a chunk besides",
                              minimum=1)
    # keyword parameters of the codec beyond `fraction` (e.g. {"levels": 16} for qsgd); not an
    # option of a node's TOML, a simulator scenario may set it
    codec_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        params = {"fraction": self.fraction} if self.codec in FRACTION_CODECS else {}
        object.__setattr__(self, "codec_params",
                           MappingProxyType({**params, **dict(self.codec_params)}))
        checks = {
            "fanout": self.fanout >= 0,
            "max_staleness_seconds": math.isfinite(self.max_staleness_seconds)
            and self.max_staleness_seconds >= 0,
            "max_staleness_samples": self.max_staleness_samples >= 0,
            "average_timeout_margin": math.isfinite(self.average_timeout_margin)
            and self.average_timeout_margin >= 1,
            "average_timeout_max": math.isfinite(self.average_timeout_max)
            and self.average_timeout_max > 0,
            "clip_multiple": self.clip_multiple > 0,
            "norm_window": self.norm_window >= 1,
            "absurd_norm_multiple": self.absurd_norm_multiple >= self.clip_multiple,
            "max_norm": self.max_norm > 0,
            "max_sample_weight": self.max_sample_weight > 0,
            "distance_multiple": self.distance_multiple >= 1,
            "distance_window": self.distance_window >= 1,
            "max_distance": self.max_distance > 0,
            "min_distance": 0 <= self.min_distance <= self.max_distance,
            "distance_patience": self.distance_patience >= 1,
            "queue_vectors": self.queue_vectors >= 1,
            "queue_bytes": self.queue_bytes >= 1,
            "average_every": self.average_every >= 0,
            "average_every_fast": self.average_every_fast >= 0,
            "average_fast_share": 0 < self.average_fast_share <= 1,
            "averaging": self.averaging == AUTO or self.averaging in AVERAGING_MODES,
            "subset_fraction": 0.0 < self.subset_fraction <= 1.0,
            "subset_fraction_slow (at most subset_fraction)":
                0.0 <= self.subset_fraction_slow <= self.subset_fraction,
            "average_part": self.average_part >= 1,
            "average_pull_max": 0.5 <= self.average_pull_max < 1,
            "average_pull_power": 1 <= self.average_pull_power <= 16,
            "average_explore": 0 <= self.average_explore <= 1,
            "average_draw_power": 1 <= self.average_draw_power <= 16,
            "outer_every": self.outer_every >= 0,
            "track_peers": 0 <= self.track_peers <= 64,
            "track_gamma": 0 < self.track_gamma <= 1,
            "track_warmup": self.track_warmup >= 1,
            "track_peers (not with outer steps)": self.outer_every == 0 or self.track_peers == 0,
            "outer_lr": 0 < self.outer_lr <= 4,
            "outer_momentum": 0 <= self.outer_momentum <= 1,
            "outer_feedback_bits (8 or 16)": self.outer_feedback_bits in (8, 16),
            "fanout (outer steps share progress with at least one peer)":
                self.outer_every == 0 or self.fanout >= 1,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"bad gossip settings: {', '.join(bad)}")
        self.make_codec()  # an unknown codec or bad parameters fail here, not mid-run

    def make_codec(self) -> Codec:
        """The gradient codec with its parameters (`fraction` plus `codec_params`)."""
        return make_codec(self.codec, **self.codec_params)

    @property
    def uses_error_feedback(self) -> bool:
        return self.error_feedback and bool(self.make_codec().biased)

    def averaging_due(self, step: int) -> bool:
        """True after local step `step` (1-based) if a push-pull averaging is due."""
        return self.average_every > 0 and step > 0 and step % self.average_every == 0

    def fast_averaging_due(self, step: int) -> bool:
        """True after local step `step` if an averaging with one of the fastest is due
        (never while averaging is off: `average_every = 0`)."""
        every = self.average_every_fast
        return self.average_every > 0 and every > 0 and step > 0 and step % every == 0

    def fast_core(self, fast: int, members: int) -> bool:
        """Whether `fast` of the swarm's fastest (this node among them) out of `members`
        known alive (this node among them) are few enough for their extra exchanges."""
        return fast <= self.average_fast_share * members

    def distance_guard(self) -> DistanceGuard:
        """A fresh guard on averaging snapshots with these bounds."""
        return DistanceGuard(self.distance_multiple, self.distance_window, self.max_distance,
                             self.distance_patience, self.min_distance)

    def averaging_mode(self, flops_per_coordinate: float) -> str:
        """The averaging mode in force: `averaging`, with auto resolved by the model's FLOPs
        per sample for each coordinate of the flat vector (the one that travels). Every
        node of a swarm has the same model, so every node resolves auto alike."""
        if self.averaging != AUTO:
            return self.averaging
        return "int8" if flops_per_coordinate >= AUTO_FULL_FLOPS else "subset_int8"

    def averaging_plan(self, n: int, flops_per_coordinate: float) -> AveragingPlan:
        return AveragingPlan.from_mode(n, self.averaging_mode(flops_per_coordinate),
                                       self.subset_fraction, self.average_part,
                                       self.subset_fraction_slow or None)
