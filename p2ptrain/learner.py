"""A node's training state and its local step: parameters, gradient, AdamW, data position,
swarm sample count.

This is the pure part of training: `train_step()` draws the next batch, computes the
gradient (accumulating micro-batches), clips it, and applies AdamW at the learning rate the
swarm sample count gives. It never reads the clock or touches a file or socket, so the
runtime can run it in a worker thread and the simulator can charge modelled time for it.
Snapshots for checkpoints are views of the live buffers; `restore` loads one back. The
buffers of the model's size are the weights, the gradient and AdamW's two moments (plus a
micro-batch gradient when accumulating, and with `train.ema` the average of the weights over
the last steps, which checkpoints then carry): nothing here allocates another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from p2ptrain import checkpoint
from p2ptrain.codecs.kernels import all_finite
from p2ptrain.data import Corpus, Sampler, eval_windows
from p2ptrain.data.sampler import shard_seed
from p2ptrain.models import Model, fingerprint
from p2ptrain.optim import AdamW, Progress, Schedule, clip_global_norm
from p2ptrain.options import option
from p2ptrain.outerstate import OUTER, state_arrays
from p2ptrain.owed8 import Owed8
from p2ptrain.swarmcount import SwarmCount

COUNT_MAX = 2**53  # a count, step or position a checkpoint's resume data may hold

DIVERGED_HINT = ("lower the learning rate (--lr) or lengthen the warm-up; the checkpoints "
                 "written before it are kept")
BETA_MAX = 0.999999  # Adam's decays: 1 divides by zero in the bias correction
EVAL_BATCH = 32  # held-out windows per forward pass, at most (never more than a micro-batch)
AVERAGE_CHUNK = 1 << 20  # coordinates the average of the weights is updated by at a time
LIVE_WEIGHTS = "weights.trained"  # state tensor: the weights, when the model is their average
EMA_STEPS = "ema_steps"  # state meta: steps in that average
JUDGE_WINDOWS = 16  # held-out windows a fetched checkpoint is judged on


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """[train] (p2ptrain.settings): batch, optimiser, schedule and the bounds of a run."""

    batch: int = option(0, "samples per step; 0: chosen from the hardware", flag="--batch",
                        minimum=0, maximum=1 << 24)
    accum: int = option(0, "micro-batches per step; 0: chosen from memory", minimum=0)
    lr: float = option(4e-3, "peak learning rate", flag="--lr", minimum=0)
    min_lr_ratio: float = option(0.1, "cosine floor as a fraction of the peak", minimum=0,
                                 maximum=1)
    warmup_samples: int = option(1600, "samples of linear warm-up", minimum=0)
    total_samples: int = option(200_000, "swarm samples of the whole run: the schedule's "
                                "length; the run ends there", minimum=1)
    weight_decay: float = option(0.01, "decoupled weight decay on matrices", minimum=0)
    beta1: float = option(0.9, "Adam first-moment decay, below 1", minimum=0, maximum=BETA_MAX)
    beta2: float = option(0.99, "Adam second-moment decay, below 1", minimum=0,
                          maximum=BETA_MAX)
    grad_clip: float = option(1.0, "global gradient-norm clip; 0: off", minimum=0)
    seed: int = option(0, "seed of the initial weights (the same on every node) and of the "
                       "data order", flag="--seed", minimum=0)
    steps: int = option(0, "stop after this many local steps; 0: no limit", flag="--steps",
                        minimum=0)
    duration: float = option(0.0, "stop after this many seconds; 0: no limit",
                             flag="--duration", minimum=0)
    target_step_seconds: float = option(0.25, "step time the automatic batch size aims at",
                                        minimum=0.01)
    ema: float = option(0.0, "keep an exponential moving average of the weights, each step "
                        "weighing 1 - ema (0.99: about the last 100 steps), and put it in "
                        "checkpoints instead of the weights; 0: off. 4 B per trained "
                        "parameter more; unset, 0.99 in LoRA mode (train.mode = lora) and "
                        "off in full training", minimum=0)
    mode: str = option("full", "full: every weight trains; lora: low-rank adapters on a "
                       "frozen 16-bit base ([lora]), only they travel", flag="--mode",
                       choices=("full", "lora"))


# `train.ema` when unset in LoRA mode (BENCHMARKS §16, 2026-12-03): in the seed-1b-lora
# scenario the checkpoints reached the target 1.1-1.3x sooner and ended 1.8-2.7% lower, for
# 4 B per adapter parameter (51 MB at seed-1b's 12.8M). Full training leaves it off: 4 B/param
# on the ~17 B/param plan of a big model on a Pi (§14) is too much to spend unasked.
LORA_EMA = 0.99


def ema_decay(ema: float, steps: int) -> float:
    """The decay of the average of the weights after `steps` steps in it: `ema`, but at most
    (1 + steps) / (10 + steps) -- 0.18 after one, 0.9 after 80, 0.99 after 890 -- so that an
    average just started, or started again after a restore, follows the weights instead of
    dragging its first steps along for ~1 / (1 - ema) steps."""
    return min(ema, (1.0 + steps) / (10.0 + steps))


@dataclass(frozen=True, slots=True)
class StepResult:
    loss: float  # mean training loss of the step's batch (nats/token)
    grad_norm: float  # global gradient norm before clipping
    lr: float  # learning rate applied
    samples: int  # samples (windows) in the step
    tokens: int  # tokens predicted in the step


class Learner:
    def __init__(self, model: Model, node_id: str, train: TrainConfig, corpus: Corpus,
                 batch: int, accum: int, eval_count: int):
        if batch < 1 or accum < 1 or batch % accum:
            raise ValueError(f"batch {batch} must be a positive multiple of accum {accum}")
        self.model = model
        self.node_id = node_id
        self.batch, self.accum = batch, accum
        self.fingerprint = fingerprint(model, corpus.tokenizer_id)
        self.tokenizer_id, self.tokenizer_json = corpus.tokenizer_id, corpus.tokenizer_json
        space = model.space
        self.params = space.zeros()
        model.init_params(self.params, np.random.default_rng(train.seed))  # same on every node
        self.grad = space.zeros()
        self._micro_grad = space.zeros() if accum > 1 else self.grad
        self.opt = AdamW(space, train.beta1, train.beta2, weight_decay=train.weight_decay)
        self.schedule = Schedule(train.lr, train.warmup_samples, train.total_samples,
                                 train.min_lr_ratio)
        self.grad_clip = train.grad_clip
        self.total_samples = train.total_samples
        self.sampler = Sampler(corpus.train, model.ctx_len + 1, shard_seed(node_id, train.seed))
        # where the data stands for the steps applied (a checkpoint's): the sampler itself runs
        # ahead while the next step draws its batch in the step thread
        self.data_position = self.sampler.position()
        self.heldout = eval_windows(corpus.heldout, model.ctx_len + 1, eval_count)
        self.eval_batch = min(EVAL_BATCH, batch // accum)  # windows per evaluation forward
        self.count = SwarmCount()
        self.step = 0  # local steps taken
        self.samples = 0  # local samples trained on
        self.progress: Progress | Owed8 | None = None  # set by an outer optimiser: steps summed
        self.outer: Any = None  # the outer optimiser (its state goes into checkpoints)
        self.outer_saved: dict[str, Any] | None = None  # its state from our own checkpoint
        if not 0.0 <= train.ema < 1.0:
            raise ValueError(f"train.ema must be in [0, 1), not {train.ema}")
        self.ema = train.ema
        self.average: np.ndarray | None = None  # train.ema: the weights averaged over steps
        self.averaged = 0  # steps in the average since it started

    @property
    def swarm_samples(self) -> int:
        return self.count.total

    @property
    def finished(self) -> bool:
        """The swarm has trained the whole run (`train.total_samples`)."""
        return self.count.total >= self.total_samples

    def train_step(self) -> StepResult:
        """One local step alone: this node's gradient, applied as it is."""
        loss = self.compute_gradient()
        return self.apply_gradient(self.grad, loss)

    def compute_gradient(self) -> float:
        """Fill `self.grad` with the mean gradient over the next `batch` samples (in `accum`
        micro-batches); returns their mean loss. Parameters are not changed."""
        micro = self.batch // self.accum
        loss = 0.0
        for i in range(self.accum):
            tokens = self.sampler.next_batch(micro)
            loss += self.model.loss_and_grad(self.params, tokens, self._micro_grad)
            if self.accum > 1:
                if i == 0:
                    np.copyto(self.grad, self._micro_grad)
                else:
                    self.grad += self._micro_grad
        if self.accum > 1:
            self.grad *= 1.0 / self.accum
        return loss / self.accum

    def apply_gradient(self, grad: np.ndarray, loss: float) -> StepResult:
        """Clip `grad` (in place) and take an AdamW step with it at the learning rate of the
        current swarm sample count; credits this node's `batch` samples."""
        norm = clip_global_norm(grad, self.grad_clip)
        if not np.isfinite(norm):
            raise FloatingPointError(f"gradient norm is {norm} at step {self.step}")
        lr = self.schedule.lr(self.count.total)
        self.opt.step(self.params, grad, lr, self.progress)
        self.update_average()
        self.step += 1
        self.samples += self.batch
        self.count.add(self.node_id, self.batch)
        self.data_position = self.sampler.position()
        return StepResult(loss, norm, lr, self.batch, self.batch * self.model.ctx_len)

    def update_average(self) -> None:
        """After a step, with `train.ema`: average <- d x average + (1 - d) x weights,
        d = `ema_decay(ema, steps in it)`, in place and in chunks (no other buffer of the
        model's size); the first step starts it at the weights."""
        if self.ema <= 0:
            return
        if self.average is None:
            self.average, self.averaged = self.params.copy(), 1
            return
        avg, params = self.average, self.params
        share = 1.0 - ema_decay(self.ema, self.averaged)
        self.averaged += 1
        for lo in range(0, len(params), AVERAGE_CHUNK):
            part = avg[lo : lo + AVERAGE_CHUNK]
            part += share * (params[lo : lo + AVERAGE_CHUNK] - part)

    def restart_average(self) -> None:
        """The weights were replaced from elsewhere: the average starts again at the next
        step, from them."""
        self.average, self.averaged = None, 0

    @property
    def checkpoint_weights(self) -> np.ndarray:
        """What a checkpoint carries as the model: the average of the weights (`train.ema`,
        once a step has started it), else the weights."""
        return self.average if self.average is not None else self.params

    def evaluate(self) -> float:
        """Mean held-out loss (nats/token) over the fixed evaluation windows."""
        return self._held_out_loss(self.params, self.heldout)

    def evaluate_average(self) -> float | None:
        """`evaluate` of the average of the weights (`train.ema`); None while there is none."""
        return None if self.average is None else self._held_out_loss(self.average, self.heldout)

    def evaluate_params(self, params: np.ndarray, windows: int = JUDGE_WINDOWS) -> float:
        """Held-out loss of other weights on the first `windows` fixed evaluation windows
        (the same on every node that reads the same corpus, to float32 rounding)."""
        return self._held_out_loss(params, self.heldout[:windows])

    def _held_out_loss(self, params: np.ndarray, windows: np.ndarray) -> float:
        """Mean loss over `windows`, in forward passes of at most one training micro-batch:
        an evaluation then needs no scratch memory beyond the training step's."""
        total, n = 0.0, 0
        for start in range(0, len(windows), self.eval_batch):
            chunk = windows[start : start + self.eval_batch]
            total += self.model.loss(params, chunk) * len(chunk)
            n += len(chunk)
        return total / n

    def judge_checkpoint(self, path: Path) -> tuple[float, float]:
        """(loss of the checkpoint's weights, loss of our own) on the same fixed held-out
        batch; inf for weights that do not load or are not finite. The checkpoint's weights
        are read into the gradient buffer: call it only while no step runs (a joining node)."""
        params = self.grad
        try:
            checkpoint.load_tensors(path, checkpoint.MODEL_FILE, self.model.space.views(params))
        except checkpoint.CheckpointError:
            return math.inf, self.evaluate_params(self.params)
        if not all_finite(params):
            return math.inf, self.evaluate_params(self.params)
        with np.errstate(all="ignore"):
            loss = self.evaluate_params(params)
        return (loss if math.isfinite(loss) else math.inf), self.evaluate_params(self.params)

    def snapshot(self, term: int) -> checkpoint.Snapshot:
        space = self.model.space
        outer_meta, outer_tensors = self.outer.state() if self.outer is not None else (None, [])
        state_meta = {"step": self.step, "samples": self.samples, "adam_t": self.opt.t,
                      "node_id": self.node_id, "data": dict(self.data_position)}
        if outer_meta is not None:
            state_meta[OUTER] = outer_meta
        live = []  # with an average in the model file, the trained weights go with the state
        if self.average is not None:
            state_meta[EMA_STEPS] = self.averaged
            live = [(LIVE_WEIGHTS, self.params)]
        return checkpoint.Snapshot(
            step=self.step,
            term=term,
            swarm_count=self.count.as_dict(),
            fingerprint=self.fingerprint,
            arch=self.model.arch(),
            model_tensors=[(s.name, space.view(self.checkpoint_weights, s.name)) for s in space],
            state_tensors=[("adam.m", self.opt.m), ("adam.v", self.opt.v), *outer_tensors,
                           *live],
            model_meta={} if self.tokenizer_json is None else {
                checkpoint.TOKENIZER_META_KEY: self.tokenizer_json},
            state_meta=state_meta,
        )

    def restore(self, path: Path, manifest: checkpoint.Manifest, with_state: bool = True,
                with_count: bool = True) -> None:
        """Load weights (and, with_state, optimiser moments and data position; with_count,
        the swarm counter) from a verified checkpoint; call it between steps. The weights are
        checked before the live ones change: they are read into the gradient buffer first (no
        second copy of the model). The moments are read in place, after every other check: a
        file that fails then (changed on disk since it was verified) leaves them reset.
        Our own checkpoint whose model is the average of the weights (`train.ema`) gives back
        both: the trained weights from its state, and the average goes on from the model
        file (with train.ema off now, the trained weights alone); any other checkpoint's model
        becomes the weights and a new average starts from them."""
        space = self.model.space
        count = SwarmCount(manifest.swarm_count)
        if with_state:
            # the resume data first (the header alone: no tensor is read)
            meta = checkpoint.state_meta(checkpoint.load_tensors(path, checkpoint.STATE_FILE, {}))
            try:
                step, samples, adam_t = int(meta["step"]), int(meta["samples"]), int(meta["adam_t"])
                data = meta["data"]
                epoch, index = int(data["epoch"]), int(data["index"])
            except (KeyError, TypeError, ValueError, OverflowError) as exc:  # (int(1e999))
                raise checkpoint.CheckpointError(f"{path.name}: bad resume data ({exc})") from None
            if not all(0 <= v <= COUNT_MAX for v in (step, samples, adam_t, epoch, index)):
                raise checkpoint.CheckpointError(f"{path.name}: resume data out of range (step, "
                                                 f"samples, adam_t or data position)")
            same_node = meta.get("node_id") == self.node_id
        staged = self.grad  # free between steps; overwritten by the next one
        checkpoint.load_tensors(path, checkpoint.MODEL_FILE, space.views(staged))
        if not all_finite(staged):
            raise checkpoint.CheckpointError(f"{path.name}: weights hold non-finite values")
        live, ema_steps = None, 0  # our own trained weights, when the model is their average
        if with_state and same_node and meta.get(EMA_STEPS) is not None:
            try:
                ema_steps = int(meta[EMA_STEPS])
            except (TypeError, ValueError, OverflowError):
                raise checkpoint.CheckpointError(f"{path.name}: bad {EMA_STEPS}") from None
            live = space.zeros()  # becomes the average's buffer below
            checkpoint.load_tensors(path, checkpoint.STATE_FILE, {LIVE_WEIGHTS: live})
            if ema_steps < 1 or not all_finite(live):
                raise checkpoint.CheckpointError(f"{path.name}: bad trained weights")
        if with_state:
            # the outer optimiser's state: our own only (another node's owes its own progress)
            outer = state_arrays(meta.get(OUTER), space.n_params) if same_node else None
            try:
                checkpoint.load_tensors(path, checkpoint.STATE_FILE,
                                        {"adam.m": self.opt.m, "adam.v": self.opt.v,
                                         **(outer or {})})
                if not (all_finite(self.opt.m) and all_finite(self.opt.v)
                        and float(self.opt.v.min(initial=0.0)) >= 0.0):  # else the first
                    raise checkpoint.CheckpointError(  # steps "diverge", blaming the lr
                        f"{path.name}: optimiser moments not finite, or a negative variance")
            except checkpoint.CheckpointError:
                self.opt.reset()
                raise
            self.outer_saved = None if outer is None else {"meta": meta[OUTER], "arrays": outer}
        np.copyto(self.params, staged if live is None else live)
        self.restart_average()
        if live is not None and self.ema > 0:  # our own average goes on
            np.copyto(live, staged)
            self.average, self.averaged = live, ema_steps
        staged.fill(0.0)
        if with_count:
            self.count.merge(count.as_dict())  # merged: what this node knew is never lost
        if with_state:
            self.opt.t = adam_t
            self.step = step
            self.samples = samples
            if same_node:  # another node's data position means nothing for our shard
                self.sampler = Sampler(self.sampler.tokens, self.sampler.window,
                                       self.sampler.seed, epoch, index)
                self.data_position = self.sampler.position()
