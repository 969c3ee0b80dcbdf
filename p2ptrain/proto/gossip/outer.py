"""Pseudo-gradient gossip: the outer optimiser of `gossip.outer_every = H > 0` (DiLoCo's outer
step with SparseLoCo's compression -- top-k of an error-feedback accumulator that doubles as
outer momentum -- made gossip).

Between outer steps a node trains alone; its optimiser sums how far each step moved the
replica (`optim.Progress`: the round's pseudo-gradient d, bfloat16 rounded stochastically).
Every H local steps:

1. e = beta e + d: the error-feedback accumulator takes the round's progress (what earlier
   rounds did not send, decayed: the decay makes it an outer momentum, as in SparseLoCo).
2. c = compress(e) (the codec, top-k by default) goes to `fanout` peers as ordinary gradient
   chunk messages (weight: the round's samples); e keeps e - c for later rounds.
3. The replica goes back to where the round started (x += d: the anchor, without a copy of
   it) and moves by the weighted average of its own c and the peers' c received since its
   last outer step (the gradient mixer: sample weights, median-norm clipping), times lr.

So replicas restart every round from an anchor they (nearly) share, and what is not sent yet
waits in e instead of pulling the replicas apart. Parameter averaging beside (`average_every`)
averages the anchors, x + d, not the replicas (averaging.py: `ParameterAverager.anchor`):
the rewind takes back only the own steps, so a mid-round snapshot of x would leave the two
sides' partial progress in each other's anchor. With lr 1, beta 0, no compression and every
peer's c it is exactly averaging the replicas' progress. Bytes per round: fanout compressed
vectors, against one dense vector per *step* for gradient exchange. Extra state: d in
bfloat16 (2 bytes a parameter) and e in `outer_feedback_bits` (owed8.py: 8 bits and a scale
per 256, 1.016 bytes; or bfloat16), no anchor copy, no separate momentum.

`outer_rewind = false` (keep the owed progress) needs no d: the replica is not sent back, so
every step's progress goes straight into e, and after sharing e keeps beta (e - c) -- the
same e at every share as above (beta e + d), in one vector: 1.016 bytes a parameter at 8 bits.

Pure: no I/O, no clock; randomness from the seeds given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from p2ptrain.codecs.kernels import blocks, chunk_seed
from p2ptrain.codecs.wire import HEADER_SIZE, Origin, chunk_bounds, encode_chunk
from p2ptrain.optim import Progress
from p2ptrain.outerstate import OUTER, describe, finite, parts, state_arrays
from p2ptrain.owed8 import Owed8
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.messages import GradientPush
from p2ptrain.proto.gossip.mixer import MixReport
from p2ptrain.proto.messages import Out


def owed_vector(n: int, bits: int, seed: int) -> Progress | Owed8:
    """An accumulator of n coordinates in `bits` (8: owed8.Owed8, 16: bfloat16)."""
    return Owed8(n, seed) if bits == 8 else Progress(n, seed)


class OuterOptimizer:
    """Round progress, error feedback and the outer step of one replica of n parameters."""

    def __init__(self, config: GossipConfig, n: int, seed: int,
                 saved: Mapping[str, Any] | None = None):
        self.every = config.outer_every
        self.lr, self.beta = config.outer_lr, config.outer_momentum
        self.codec = config.make_codec()
        self.n = int(n)
        self.rewinds = config.outer_rewind
        bits = config.outer_feedback_bits
        # e: what is owed; without rewinding, the steps add to it directly (no d)
        self.feedback = owed_vector(n, bits, seed ^ 0x5EED)
        # d: this round's progress, bfloat16 (the replica goes back by it exactly)
        self.progress = Progress(n, seed) if self.rewinds else self.feedback
        self._wide = np.zeros(0, np.float32)
        self.rounds = 0
        self.restored = saved is not None and self.restore(saved)

    # -- in a checkpoint: a node that resumes from its own keeps what it owed ----------------

    def state(self) -> tuple[dict[str, Any], list[tuple[str, np.ndarray]]]:
        """(its description, [(tensor name, array)]): views of the live vectors, for the state
        file of a checkpoint (p2ptrain/outerstate.py names them)."""
        arrays = [(f"{OUTER}.feedback.{k}", v) for k, v in parts(self.feedback).items()]
        if self.rewinds:
            arrays.append((f"{OUTER}.progress.bits", self.progress.bits))
        return describe(self.feedback, self.rewinds, self.n), arrays

    def handover(self) -> dict[str, Any]:
        """Its vectors in `restore`'s form, for the optimiser of a new trainer over the same
        learner (a node rebuilt mid-round, e.g. on becoming outbound-only)."""
        meta, arrays = self.state()
        return {"meta": meta, "arrays": dict(arrays)}

    def restore(self, saved: Mapping[str, Any]) -> bool:
        """Adopt a checkpoint's vectors (`saved`: {"meta", "arrays"}, read into
        `state_arrays(meta, n)`); False, and nothing changed, unless they are this
        optimiser's kind (bits, rewinding, size) and finite: it then starts at zero."""
        meta, arrays = saved.get("meta"), saved.get("arrays")
        want = state_arrays(meta, self.n)
        if (want is None or meta != describe(self.feedback, self.rewinds, self.n)
                or not isinstance(arrays, Mapping) or set(arrays) != set(want)):
            return False
        if any(not isinstance(arrays[k], np.ndarray) or arrays[k].dtype != w.dtype
               or arrays[k].shape != w.shape for k, w in want.items()) or not finite(arrays):
            return False
        for name, a in arrays.items():
            owner = self.progress if name.startswith(f"{OUTER}.progress") else self.feedback
            setattr(owner, name.rsplit(".", 1)[1], a)
        return True

    def due(self, step: int) -> bool:
        """True after local step `step` (1-based) when an outer step is due."""
        return self.every > 0 and step > 0 and step % self.every == 0

    def share(self, into: np.ndarray, *, sender: bytes, swarm: int, weight: float, seed: int,
              chunk_elems: int) -> list[bytes]:
        """e = beta e + d; the messages of c = compress(e), chunk by chunk; e keeps e - c.
        Without rewinding, e already holds d and keeps beta (e - c). `into` (float32, n: a
        free buffer such as the gradient's) is set to c."""
        bounds = chunk_bounds(self.n, chunk_elems)
        header = Origin(sender, swarm, weight)
        codec, out = self.codec, []
        for index, (offset, length) in enumerate(bounds):
            part = into[offset : offset + length]
            end = offset + length
            self.feedback.read(offset, end, part)
            if self.rewinds:
                if self._wide.shape[0] < length:
                    self._wide = np.zeros(length, np.float32)
                d = self._wide[:length]
                part *= np.float32(self.beta)
                self.progress.read(offset, end, d)
                part += d  # part = e
            cseed = chunk_seed(seed, index)
            msg = encode_chunk(codec, part, header, self.n, offset, index, len(bounds), cseed)
            payload = memoryview(msg)[HEADER_SIZE : HEADER_SIZE + codec.encoded_size(length)]
            codec.decode_into(payload, part, -1.0, cseed)  # part = e - c
            if not self.rewinds:
                part *= np.float32(self.beta)  # the next round's steps add to beta (e - c)
            self.feedback.write(offset, end, part)
            part.fill(0.0)
            codec.decode_into(payload, part, 1.0, cseed)  # part = c
            out.append(bytes(msg))
        return out

    def give_back(self, params: np.ndarray, shared: np.ndarray) -> None:
        """params += c (`outer_rewind = false`): only what was sent is replaced by the
        average; the replica keeps the progress it still owes (in e, where the next round's
        steps add theirs)."""
        if self.rewinds:
            raise RuntimeError("give_back is the outer step without rewinding")
        params += shared

    def rewind(self, params: np.ndarray) -> None:
        """params += d: back to where the round started; the next round's d starts at 0."""
        if not self.rewinds:
            raise RuntimeError("rewind needs outer_rewind = true")
        for lo, hi in blocks(self.n):
            if self._wide.shape[0] < hi - lo:
                self._wide = np.zeros(hi - lo, np.float32)
            d = self._wide[: hi - lo]
            self.progress.read(lo, hi, d)
            params[lo:hi] += d
        self.progress.reset()

    def apply(self, params: np.ndarray, avg: np.ndarray) -> None:
        """params -= lr avg (avg: the averaged shared progress; scratch, scaled in place)."""
        if self.lr != 1.0:
            avg *= np.float32(self.lr)
        params -= avg
        self.rounds += 1

    def reset(self) -> None:
        """Forget progress and what is owed (the replica was replaced)."""
        self.progress.reset()
        self.feedback.reset()  # (the same vector without rewinding)


def capped(avg: np.ndarray, cap: float) -> bool:
    """Scale `avg` down to norm `cap` if it is longer (and cap > 0): the average goes straight
    into the weights, so it moves them at most `clip_multiple` times the node's own share,
    whatever the peers' vectors passed (the mixer's clip is relative to a median that one
    peer can half set at a cold start). Whether it scaled."""
    norm = float(np.sqrt(np.dot(avg, avg)))
    if not cap > 0 or norm <= cap:
        return False
    avg *= np.float32(cap / norm)
    return True


def outer_step(trainer: Any, now: float, loss: float,
               targets: Sequence[tuple[str, str]], partners: Sequence[tuple[str, str]],
               out: list[Out]) -> MixReport:
    """The step of a GossipTrainer (`trainer`) with `outer_every` > 0: a local step; every
    `outer_every` steps also the outer step (above): share the compressed progress with
    `fanout` targets, go back to the round's start, move by the average."""
    learner, outer = trainer.learner, trainer.outer
    result = learner.apply_gradient(learner.grad, loss)
    report = MixReport(result.grad_norm, 0.0, float(learner.batch), (), 0, 0,
                       trainer.mixer.pending)
    if outer.due(learner.step):
        swarm, step = learner.count.total, learner.step
        weight = min(float(learner.batch * outer.every), trainer.config.max_sample_weight)
        chunks = outer.share(learner.grad, sender=trainer.sender, swarm=swarm, weight=weight,
                             seed=(trainer._seed_base + step) % 2**64,
                             chunk_elems=trainer.chunk_elems)
        trainer.latest = (step, loss, chunks)
        addrs, size = dict(targets), sum(len(c) for c in chunks)
        for peer in trainer.peers.choose(addrs, trainer.config.fanout, trainer.rng, size):
            out.extend(Out(peer, addrs[peer], GradientPush(step, loss, c)) for c in chunks)
            trainer.stats["outer_pushes"] += 1
            trainer.stats["outer_bytes_sent"] += size
        if trainer.config.outer_rewind:
            outer.rewind(learner.params)  # back to the round's start: the anchor
        else:
            outer.give_back(learner.params, learner.grad)
        report = trainer.mixer.mix(learner.grad, weight, swarm)
        if capped(learner.grad, trainer.config.clip_multiple * report.own_norm):
            trainer.stats["outer_capped"] += 1
        outer.apply(learner.params, learner.grad)
        trainer.stats["outer_steps"] += 1
    trainer.last_mix = report
    trainer._average_if_due(now, partners, out)
    return report
