"""Generating text from a model, byte by byte (pure: the generator is passed in)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from p2ptrain.models import Model


def generate(model: Model, params: np.ndarray, prompt: bytes, length: int, temperature: float,
             rng: np.random.Generator) -> Iterator[int]:
    """Yield `length` bytes continuing `prompt`, each drawn from the model's distribution at
    `temperature` (0: always the most likely byte). The model sees the last ctx_len bytes."""
    context = list(prompt) or [ord("\n")]
    for _ in range(length):
        window = np.asarray(context[-model.ctx_len :], dtype=np.int64)[None, :]  # (1, T)
        logits = model.logits(params, window)[0, -1].astype(np.float64)  # (V,)
        if temperature == 0:
            byte = int(np.argmax(logits))
        else:
            z = logits / temperature
            z -= z.max()
            probs = np.exp(z)
            probs /= probs.sum()
            byte = int(rng.choice(len(probs), p=probs))
        context.append(byte)
        yield byte
