"""Pseudo-gradient gossip: the outer optimiser of `gossip.outer_every = H > 0` (DiLoCo's outer
step, with SparseLoCo/DeMo-style compression, made gossip).

Between outer steps a node trains alone; its optimiser sums how far each step moved the
replica (`optim.Progress`, bfloat16 rounded stochastically: the accumulator of own progress
not yet shared). Every H local steps:

1. c = compress(a): the codec (top-k by default) keeps part of the accumulator a; the rest
   stays in a for later rounds (error feedback: nothing is lost, only delayed). c goes to
   `fanout` peers as ordinary gradient chunk messages (weight: the round's samples).
2. The replica gives c back (x += c: what it shares is replaced by the average), then moves
   by the weighted average of its own c and the peers' c received since its last outer step
   (the gradient mixer: sample weights, median-norm clipping), through Nesterov momentum:
   m = mu m + avg;  x -= lr (avg + mu m).

With lr 1, no momentum, no compression and every peer's c this is exactly parameter
averaging of the replicas' progress (x_i = A - a_i: a consensus point A minus the own
unshared progress). Bytes per round: fanout compressed vectors, against one dense vector per
*step* for gradient exchange. Extra state: the accumulator and the momentum, 2 bytes a
parameter each; no anchor copy of the model is needed, and the error-feedback residual *is*
the accumulator.

Pure: no I/O, no clock; randomness from the seeds given.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs.kernels import (
    bf16_bits_to_f32,
    bit_stream,
    blocks,
    chunk_seed,
    f32_to_bf16_stochastic,
)
from p2ptrain.codecs.wire import HEADER_SIZE, Origin, chunk_bounds, encode_chunk
from p2ptrain.optim import Progress
from p2ptrain.proto.gossip.config import GossipConfig


class OuterOptimizer:
    """Progress, momentum and the outer step of one replica of n parameters."""

    def __init__(self, config: GossipConfig, n: int, seed: int):
        self.every = config.outer_every
        self.lr, self.mu = config.outer_lr, config.outer_momentum
        self.codec = config.make_codec()
        self.n = int(n)
        self.progress = Progress(n, seed)
        self.momentum = np.zeros(n, np.uint16) if self.mu > 0 else None  # bfloat16 bits
        self._stream = bit_stream(seed ^ 0x5EED)  # the momentum's rounding
        self._wide = np.zeros(0, np.float32)
        self.rounds = 0

    def due(self, step: int) -> bool:
        """True after local step `step` (1-based) when an outer step is due."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def share(self, into: np.ndarray, *, sender: bytes, swarm: int, weight: float, seed: int,
              chunk_elems: int) -> list[bytes]:
        """The messages of c = compress(progress), chunk by chunk; `into` (float32, n: a free
        buffer such as the gradient's) is set to c and the progress keeps a - c."""
        bounds = chunk_bounds(self.n, chunk_elems)
        header = Origin(sender, swarm, weight)
        codec, out = self.codec, []
        for index, (offset, length) in enumerate(bounds):
            part = into[offset : offset + length]
            bits = self.progress.bits[offset : offset + length]
            bf16_bits_to_f32(bits, part)  # part = a
            cseed = chunk_seed(seed, index)
            msg = encode_chunk(codec, part, header, self.n, offset, index, len(bounds), cseed)
            payload = memoryview(msg)[HEADER_SIZE : HEADER_SIZE + codec.encoded_size(length)]
            codec.decode_into(payload, part, -1.0, cseed)  # part = a - c
            f32_to_bf16_stochastic(part, bits, self.progress.stream)
            part.fill(0.0)
            codec.decode_into(payload, part, 1.0, cseed)  # part = c
            out.append(bytes(msg))
        return out

    def apply(self, params: np.ndarray, avg: np.ndarray) -> None:
        """The outer step along `avg` (the averaged shared progress), in place:
        m = mu m + avg; params -= lr (avg + mu m) (Nesterov), block by block."""
        if self.momentum is None:  # avg is scratch (the gradient buffer): scaled in place
            if self.lr != 1.0:
                avg *= np.float32(self.lr)
            params -= avg
            self.rounds += 1
            return
        for lo, hi in blocks(self.n):
            if self._wide.shape[0] < hi - lo:
                self._wide = np.zeros(hi - lo, np.float32)
            m = self._wide[: hi - lo]
            bf16_bits_to_f32(self.momentum[lo:hi], m)
            m *= np.float32(self.mu)
            m += avg[lo:hi]
            f32_to_bf16_stochastic(m, self.momentum[lo:hi], self._stream)
            m *= np.float32(self.mu)
            m += avg[lo:hi]
            m *= np.float32(self.lr)
            params[lo:hi] -= m
        self.rounds += 1

    def reset(self) -> None:
        """Forget progress and momentum (the replica was replaced)."""
        self.progress.reset()
        if self.momentum is not None:
            self.momentum.fill(0)
