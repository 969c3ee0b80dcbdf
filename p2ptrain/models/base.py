"""The interface every built-in model keeps: named arrays in a ParamSpace, and a loss with a
hand-written gradient over a batch of token windows.

A model object holds only its architecture; parameters, gradients and scratch live in flat
buffers owned by the caller. The dtype of the buffers passed in is the dtype computed in
(float32 for training, float64 for finite-difference checks). Models never read the clock,
draw from global random state, or do I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from p2ptrain.params import ParamSpace


class Model(ABC):
    """A language model over byte tokens: tokens (B, T+1) -> next-token loss on T positions."""

    name: str  # registry name, e.g. "rwkv"
    mode = "full"  # "full": every weight trains; "lora": adapters on a frozen base
    space: ParamSpace  # layout of parameters (and of gradients)
    vocab_size: int  # number of token ids (256 for bytes)
    ctx_len: int  # T: positions per training window; a batch is (B, T+1) tokens

    @abstractmethod
    def init_params(self, flat: np.ndarray, rng: np.random.Generator) -> None:
        """Fill `flat` with fresh initial parameters drawn from `rng`."""

    @abstractmethod
    def loss_and_grad(self, flat: np.ndarray, tokens: np.ndarray, grad: np.ndarray) -> float:
        """Mean cross-entropy (nats/token) of predicting tokens[:, 1:] from tokens[:, :-1];
        writes d(loss)/d(params) into `grad` (overwritten, same layout as `flat`)."""

    @abstractmethod
    def loss(self, flat: np.ndarray, tokens: np.ndarray) -> float:
        """Forward only: the same mean cross-entropy, no gradient."""

    @abstractmethod
    def logits(self, flat: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Forward only: (B, T, vocab) logits for inputs tokens (B, T)."""

    @abstractmethod
    def flops_per_token(self) -> float:
        """Floating-point operations of forward + backward per token (for benchmarks and the
        simulator's compute model); formula documented in docs/BENCHMARKS.md."""

    @abstractmethod
    def activation_bytes_per_sample(self) -> int:
        """Peak float32 bytes of activations kept for backward, per window of ctx_len tokens
        (for choosing a batch size that fits memory)."""

    @abstractmethod
    def arch(self) -> dict:
        """Architecture as plain data; equal arch => interchangeable flat buffers."""
