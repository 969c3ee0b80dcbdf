"""The memory a node needs to train a model, and the largest model of the rwkv family that fits
a machine: the measured memory model of issue 15 (docs/BENCHMARKS.md §14).

Peak resident memory of a node training N float32 parameters:

    OVERHEAD                 interpreter, numpy/BLAS, the libraries, the built-in corpus
  + 16 B x N                 weights, gradient, AdamW's two moments
  + 4 B x N                  a micro-batch gradient, when a step accumulates (accum > 1)
  + 4 B x N                  the average of the weights over steps, with train.ema > 0
  + activations              the model's scratch for one micro-batch; evaluation reuses it
  + 1.125 B x corpus tokens  a --data corpus (bytes, and the epoch's window starts)
  networked (not --alone), bounds:
  + NET_OVERHEAD             HTTP server and client (measured)
  + body memory              request bodies held at once (net.body_memory_mib, 64 MiB)
  + 2 x 4 B x part           the two averaging snapshot buffers (gossip.average_part)
  + held averaging           half steps held while a step runs: 4 B x max(N/8, 2^24) + a part
  with gradient pushes (gossip.fanout > 0):
  + 4 B x N + queue_bytes    the error-feedback residual; the peer gradients waiting
  with outer steps (gossip.outer_every > 0) instead:
  + 3.02 B x N + queue_bytes the round's progress (bfloat16) and the error feedback (8 bits
                             and a scale per 256: gossip.outer_feedback_bits; 2 B x N at 16);
                             the peer pseudo-gradients waiting (gossip.outer_rewind = false
                             keeps one vector, the error feedback: 1.02 B x N)
In LoRA mode N is the adapters' count, plus
  + 2 B x the base            the frozen 16-bit base's pages (mapped; shared between nodes)
  + LORA_SCRATCH              base blocks widened to float32, adapter products

Checkpoint writes add nothing (written from the live buffers), nor does resuming (weights
staged in the gradient buffer). Measured peaks are within a few percent of this (the test
holds a small model to 15%). This file is pure: no I/O, no clock; it builds rwkv models only
to count their parameters and activations (no buffers are allocated).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.owed8 import Owed8
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.trainer import held_capacity
from p2ptrain.settings import NetConfig

MB = 10**6
OVERHEAD = 78 * MB  # measured: `join --alone` of an 87k-parameter model (1 x 64)
NET_OVERHEAD = 4 * MB  # measured: the same networked, with no peer
BYTES_PER_PARAM = 16  # float32 weights, gradient, Adam m, Adam v
GOSSIP = GossipConfig()  # the defaults of gossip.queue_bytes and gossip.average_part
BODY_MEMORY = int(NetConfig().body_memory_mib * 2**20)  # the default net.body_memory_mib
CORPUS_BYTES_PER_TOKEN = 1.125  # uint8 tokens + int64 window starts every 64 tokens
CHANNELS_PER_LAYER = 64  # the family: n_layer = n_embd / 64 (RWKV-4 169M: 12 x 768)
CHANNEL_STEP = 64  # n_embd moves in steps of this
LORA_SCRATCH = 16 * MB  # LoRA: widened blocks of the base and adapter products (measured 13)


@dataclass(frozen=True, slots=True)
class Footprint:
    """Peak resident bytes of one training node, by component."""

    overhead: int  # interpreter, libraries, built-in corpus (+ networking)
    weights: int
    gradient: int
    moments: int  # AdamW m and v
    micro_gradient: int  # accumulation buffer (accum > 1)
    activations: int  # scratch of one micro-batch (forward + backward); evaluation reuses it
    corpus: int  # a --data corpus
    averaging: int  # averaging half steps held while a step runs (networked)
    error_feedback: int  # the residual of gradient pushes (fanout > 0)
    push_queue: int  # peer gradients waiting to be mixed (fanout > 0)
    outer: int = 0  # outer steps: the round's progress and the error feedback
    base: int = 0  # LoRA: the frozen 16-bit base's mapped pages (shared between processes)
    widened: int = 0  # LoRA: blocks of the base widened to float32, adapter scratch
    average: int = 0  # train.ema: the weights averaged over steps

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


def footprint(n_params: int, activation_bytes: int, *, accum: int = 1,
              networked: bool = False, pushes: bool = False, corpus_tokens: int = 0,
              queue_bytes: int = GOSSIP.queue_bytes,
              average_part: int = GOSSIP.average_part, outer: bool = False,
              outer_rewind: bool = GOSSIP.outer_rewind,
              outer_feedback_bits: int = GOSSIP.outer_feedback_bits,
              ema: bool = False) -> Footprint:
    """The peak memory of training `n_params` parameters whose micro-batch needs
    `activation_bytes` of scratch; `networked`: not --alone; `pushes`: gossip.fanout > 0;
    `outer`: True with outer steps (gossip.outer_every > 0): the round's progress (bfloat16)
    and the error feedback (`outer_feedback_bits`; they replace the pushes' float32
    residual); without rewinding (`outer_rewind` false) the error feedback alone; `ema`: an
    average of the weights is kept (train.ema > 0)."""
    n = int(n_params)
    feedback = Owed8.bytes_for(n) if outer_feedback_bits == 8 else 2 * n
    held = 4 * (held_capacity(n) + average_part) if networked else 0
    net = NET_OVERHEAD + BODY_MEMORY + 8 * average_part if networked else 0
    return Footprint(
        overhead=OVERHEAD + net,
        weights=4 * n, gradient=4 * n, moments=8 * n,
        micro_gradient=4 * n if accum > 1 else 0,
        activations=int(activation_bytes),
        corpus=int(CORPUS_BYTES_PER_TOKEN * corpus_tokens),
        averaging=held,
        error_feedback=4 * n if pushes and not outer else 0,
        push_queue=queue_bytes if pushes or outer else 0,
        outer=(2 * n if outer_rewind else 0) + feedback if outer else 0,
        average=4 * n if ema else 0,
    )


def rwkv_footprint(config: RWKVConfig, batch: int = 1, accum: int = 1, **kwargs) -> Footprint:
    """`footprint` of the rwkv model `config` trained at `batch` samples per step in `accum`
    micro-batches (other keywords as for `footprint`)."""
    model = RWKV(config)
    micro = -(-batch // accum)
    return footprint(model.space.n_params, micro * model.activation_bytes_per_sample(),
                     accum=accum, **kwargs)


def lora_footprint(config: RWKVConfig, rank: int = 16, batch: int = 1, accum: int = 1,
                   **kwargs) -> Footprint:
    """`rwkv_footprint` in LoRA mode: the trained vector is the adapters (rank r on every
    matrix of every block), plus the base at 2 B/param and the widening scratch
    (docs/BENCHMARKS.md section 15: within 1% of the measured peak at 1.3B)."""
    from p2ptrain.models.lora import LoRAConfig, lora_sizes

    model = RWKV(config)
    adapters, _ = lora_sizes(config, LoRAConfig(rank=rank))
    micro = -(-batch // accum)
    plan = footprint(adapters, micro * model.activation_bytes_per_sample(), accum=accum,
                     **kwargs)
    return replace(plan, base=2 * model.space.n_params, widened=LORA_SCRATCH)


def rwkv_shape(n_embd: int, base: RWKVConfig | None = None) -> RWKVConfig:
    """The family's member with `n_embd` channels: n_layer = n_embd / 64 (as RWKV-4 169M and
    GPT-2 small: 12 x 768); the other fields (vocabulary, context) from `base`."""
    return replace(base or RWKVConfig(), n_embd=n_embd,
                   n_layer=max(1, n_embd // CHANNELS_PER_LAYER))


def largest_trainable(memory_bytes: float, *, base: RWKVConfig | None = None, batch: int = 1,
                      accum: int = 1, lora_rank: int = 0, **kwargs
                      ) -> tuple[int, RWKVConfig] | None:
    """(parameters, config) of the largest member of the rwkv family (`rwkv_shape`) whose
    training fits in `memory_bytes` at `batch` (keywords as for `footprint`: networked,
    pushes, corpus_tokens; lora_rank > 0: in LoRA mode at that rank); None if not even the
    smallest fits."""
    best = None
    n_embd = CHANNEL_STEP
    while True:
        config = rwkv_shape(n_embd, base)
        plan = (lora_footprint(config, lora_rank, batch, accum, **kwargs) if lora_rank
                else rwkv_footprint(config, batch, accum, **kwargs))
        if plan.total > memory_bytes:
            return best
        best = (RWKV(config).space.n_params, config)
        n_embd += CHANNEL_STEP


OS_RESERVE = 0.6 * 2**30  # what `hw` leaves the operating system (a Pi's OS and desktop)


def largest_here(memory_bytes: float) -> dict:
    """What `p2ptrain hw` reports: the largest rwkv (this module's family) this machine can
    train at batch 1 -- in full alone and as a networked node, and in LoRA mode (r16, with
    the average of the adapters that mode keeps by default: learner.LORA_EMA) -- with
    OS_RESERVE left over."""
    budget = max(0.0, memory_bytes - OS_RESERVE)
    out: dict = {"memory_budget_bytes": int(budget)}
    for key, networked, rank in (("alone", False, 0), ("networked", True, 0),
                                 ("lora", True, 16)):
        found = largest_trainable(budget, networked=networked, lora_rank=rank,
                                  ema=rank > 0)
        out[key] = None if found is None else {
            "params": found[0], "n_layer": found[1].n_layer, "n_embd": found[1].n_embd}
    return out


def describe_largest(found: dict) -> str:
    """One line for people from `largest_here`'s answer."""
    def one(entry: dict | None) -> str:
        if entry is None:
            return "nothing fits"
        return (f"{entry['params'] / 1e6:,.0f}M parameters "
                f"({entry['n_layer']} x {entry['n_embd']})")
    budget = found["memory_budget_bytes"] / 1e9
    return (f"largest trainable here (full training, batch 1, {budget:.1f} GB after "
            f"{OS_RESERVE / 2**30:.1f} GiB for the OS): {one(found['networked'])} as a swarm "
            f"node, {one(found['alone'])} alone; LoRA r16 on a 16-bit base: "
            f"{one(found.get('lora'))} as a swarm node")
