"""The mlp model's hand-written gradient against central finite differences (float64)."""

import numpy as np
import pytest

from p2ptrain.models.mlp import MLP, MLPConfig


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(a) + np.abs(b), 1e-8)))


@pytest.mark.parametrize("cfg", [
    MLPConfig(window=3, n_embd=4, n_hidden=6, n_layer=1, ctx_len=5),
    MLPConfig(window=1, n_embd=2, n_hidden=5, n_layer=2, ctx_len=3),
    MLPConfig(window=4, n_embd=3, n_hidden=4, n_layer=3, ctx_len=2),
])
def test_gradient_matches_finite_differences(cfg):
    model = MLP(cfg)
    rng = np.random.default_rng(1)
    params = model.space.zeros(np.float64)
    model.init_params(params, rng)
    params += rng.normal(0, 0.1, params.shape)  # biases away from zero, ReLUs off their kinks
    tokens = rng.integers(0, 256, size=(2, cfg.ctx_len + 1))
    grad = model.space.zeros(np.float64)
    model.loss_and_grad(params, tokens, grad)
    eps = 1e-6
    for slot in model.space:
        # every coordinate of small tensors; a seeded sample of the embedding's used rows
        idx = np.arange(slot.offset, slot.offset + slot.size)
        if slot.name == "emb":
            rows = np.unique(tokens)
            idx = np.concatenate([slot.offset + r * cfg.n_embd + np.arange(cfg.n_embd)
                                  for r in rows[:4]] + [idx[:3]])
        numeric = np.empty(idx.size)
        for j, i in enumerate(idx):
            keep = params[i]
            params[i] = keep + eps
            up = model.loss(params, tokens)
            params[i] = keep - eps
            down = model.loss(params, tokens)
            params[i] = keep
            numeric[j] = (up - down) / (2 * eps)
        assert relative_error(grad[idx], numeric) <= 1e-5, slot.name


def test_loss_at_init_is_near_uniform_and_grad_is_overwritten():
    model = MLP(MLPConfig())
    params = model.space.zeros()
    model.init_params(params, np.random.default_rng(0))
    tokens = np.random.default_rng(2).integers(0, 256, size=(4, model.ctx_len + 1))
    grad = model.space.zeros()
    grad += 123.0
    loss = model.loss_and_grad(params, tokens, grad)
    assert abs(loss - np.log(256)) < 0.3
    assert abs(loss - model.loss(params, tokens)) < 1e-5
    again = model.space.zeros()
    model.loss_and_grad(params, tokens, again)
    np.testing.assert_allclose(grad, again, rtol=1e-6, atol=1e-8)
    assert model.logits(params, tokens[:, :-1]).shape == (4, model.ctx_len, 256)
