"""`mlp`: a small, fast next-byte model (Bengio-style) for tests and large simulations.

Each position sees the embeddings of the `window` bytes before it (zero-padded at the start
of a sample), concatenated, through `n_layer` ReLU hidden layers, to vocabulary logits.
Forward and backward sit side by side; computation runs in the dtype of the buffers given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from p2ptrain.models.base import Model
from p2ptrain.models.common import cross_entropy, cross_entropy_loss
from p2ptrain.params import ParamSpace


@dataclass(frozen=True)
class MLPConfig:
    vocab_size: int = 256  # byte vocabulary
    window: int = field(default=8, metadata={"help": "mlp model: bytes of context per prediction"})
    n_embd: int = field(default=24, metadata={"help": "mlp model: embedding width per byte"})
    n_hidden: int = field(default=256, metadata={"help": "mlp model: hidden layer width"})
    n_layer: int = field(default=1, metadata={"help": "mlp model: hidden layers"})
    ctx_len: int = field(default=64, metadata={"help": "mlp model: positions per sample"})


class MLP(Model):
    name = "mlp"

    def __init__(self, config: MLPConfig):
        if min(config.window, config.n_embd, config.n_hidden, config.n_layer, config.ctx_len) < 1:
            raise ValueError(f"every mlp size must be >= 1: {config}")
        self.config = config
        self.vocab_size = config.vocab_size
        self.ctx_len = config.ctx_len
        c = config
        shapes = [("emb", (c.vocab_size, c.n_embd))]
        fan_in = c.window * c.n_embd
        for i in range(c.n_layer):
            shapes += [(f"h{i}.w", (fan_in, c.n_hidden)), (f"h{i}.b", (c.n_hidden,))]
            fan_in = c.n_hidden
        shapes += [("head.w", (c.n_hidden, c.vocab_size)), ("head.b", (c.vocab_size,))]
        self.space = ParamSpace(shapes)

    def arch(self) -> dict:
        return {"model": self.name, **asdict(self.config)}

    def init_params(self, flat: np.ndarray, rng: np.random.Generator) -> None:
        flat.fill(0.0)
        p = self.space.views(flat)
        p["emb"][...] = rng.normal(0.0, 1.0, p["emb"].shape)
        for i in range(self.config.n_layer):
            w = p[f"h{i}.w"]
            w[...] = rng.normal(0.0, np.sqrt(2.0 / w.shape[0]), w.shape)
        p["head.w"][...] = rng.normal(0.0, 0.02, p["head.w"].shape)

    def _contexts(self, inputs: np.ndarray) -> np.ndarray:
        """(B, T) inputs -> (B*T, window) byte ids of the bytes up to each position."""
        b, t = inputs.shape
        w = self.config.window
        padded = np.zeros((b, t + w - 1), dtype=np.int64)  # 0 pads the start of each sample
        padded[:, w - 1 :] = inputs
        return sliding_window_view(padded, w, axis=1).reshape(b * t, w)

    def _forward(self, flat: np.ndarray, inputs: np.ndarray):
        p = self.space.views(flat)
        ctx = self._contexts(inputs)  # (N, W)
        x = p["emb"][ctx].reshape(ctx.shape[0], -1)  # (N, W*E)
        acts = [x]
        for i in range(self.config.n_layer):
            h = x @ p[f"h{i}.w"] + p[f"h{i}.b"]  # (N, H)
            np.maximum(h, 0.0, out=h)
            acts.append(h)
            x = h
        logits = x @ p["head.w"] + p["head.b"]  # (N, V)
        return ctx, acts, logits

    def loss_and_grad(self, flat: np.ndarray, tokens: np.ndarray, grad: np.ndarray) -> float:
        p, g = self.space.views(flat), self.space.views(grad)
        grad.fill(0.0)
        ctx, acts, logits = self._forward(flat, tokens[:, :-1])
        loss, dx = cross_entropy(logits, tokens[:, 1:].reshape(-1))  # dx: (N, V)
        g["head.w"][...] = acts[-1].T @ dx
        g["head.b"][...] = dx.sum(axis=0)
        dx = dx @ p["head.w"].T  # (N, H)
        for i in reversed(range(self.config.n_layer)):
            dx *= acts[i + 1] > 0  # ReLU backward
            g[f"h{i}.w"][...] = acts[i].T @ dx
            g[f"h{i}.b"][...] = dx.sum(axis=0)
            dx = dx @ p[f"h{i}.w"].T
        demb = dx.reshape(ctx.shape[0] * ctx.shape[1], -1)  # (N*W, E)
        np.add.at(g["emb"], ctx.reshape(-1), demb)
        return loss

    def loss(self, flat: np.ndarray, tokens: np.ndarray) -> float:
        _, _, logits = self._forward(flat, tokens[:, :-1])
        return cross_entropy_loss(logits, tokens[:, 1:].reshape(-1))

    def logits(self, flat: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        _, _, logits = self._forward(flat, tokens)
        return logits.reshape(tokens.shape[0], tokens.shape[1], -1)

    def flops_per_token(self) -> float:
        # forward 2 FLOPs per multiply-add of each weight matrix; backward twice that.
        c = self.config
        macs = c.window * c.n_embd * c.n_hidden + (c.n_layer - 1) * c.n_hidden**2
        macs += c.n_hidden * c.vocab_size
        return 6.0 * macs

    def activation_bytes_per_sample(self) -> int:
        c = self.config
        per_token = c.window * c.n_embd + c.n_layer * c.n_hidden + 3 * c.vocab_size
        return 4 * c.ctx_len * per_token
