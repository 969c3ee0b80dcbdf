"""The `rwkv` model: gradients against finite differences, the chunked WKV against a plain
per-step recurrence, and the Model interface contract (loss, logits, grad overwrite, dtypes)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.models.wkv import from_chunks, to_chunks, wkv_backward, wkv_forward

# ---------------------------------------------------------------- helpers


def naive_wkv(w, u, k, v):
    """The WKV recurrence step by step, in float64 with a running max shift (the RWKV-4 CUDA
    kernel's formulation), on (C, B, T) arrays."""
    C, B, T = k.shape
    out = np.zeros((C, B, T))
    for c in range(C):
        for b in range(B):
            num, den, p = 0.0, 0.0, -1e300  # state scaled by e^{-p}
            for t in range(T):
                kt, vt = float(k[c, b, t]), float(v[c, b, t])
                q = max(p, u[c] + kt)  # output: state plus the bonus-weighted current step
                e1, e2 = math.exp(p - q), math.exp(u[c] + kt - q)
                out[c, b, t] = (e1 * num + e2 * vt) / (e1 * den + e2)
                q = max(p + w[c], kt)  # state update: decay, then add the current step
                e1, e2 = math.exp(p + w[c] - q), math.exp(kt - q)
                num, den, p = e1 * num + e2 * vt, e1 * den + e2, q
    return out


def run_wkv(w, u, k, v, chunk):
    """wkv_forward on natural-order (C, B, T) arrays."""
    B, T = k.shape[1], k.shape[2]
    out, _ = wkv_forward(w, u, to_chunks(k, chunk), to_chunks(v, chunk), T // chunk)
    return from_chunks(out, B)


def make_model(n_layer=2, n_embd=8, ctx_len=7, ffn_mult=2, wkv_chunk=4, dtype=np.float64, seed=0):
    """A model with every parameter random and away from special values (zero matrices at
    init would hide gradient bugs), in the given dtype."""
    model = RWKV(RWKVConfig(n_layer=n_layer, n_embd=n_embd, ctx_len=ctx_len,
                            ffn_mult=ffn_mult, wkv_chunk=wkv_chunk))
    rng = np.random.default_rng(seed)
    flat = model.space.zeros(np.float64)
    model.init_params(flat, rng)
    views = model.space.views(flat)
    for slot in model.space:
        view = views[slot.name]
        if slot.name.endswith("time_decay"):
            view[...] = rng.uniform(-2.0, 1.0, slot.shape)  # decays of 0.14 .. 2.7 per step
        else:
            view += rng.normal(0.0, 0.3, slot.shape)
    return model, flat.astype(dtype)


def tokens_for(B, T, seed=1):
    return np.random.default_rng(seed).integers(0, 256, (B, T + 1)).astype(np.uint8)


# ---------------------------------------------------------------- the WKV kernel


@pytest.mark.parametrize("T, chunk", [(8, 4), (5, 5), (48, 16), (6, 1), (12, 3)])
def test_chunked_wkv_matches_per_step_recurrence(T, chunk):
    rng = np.random.default_rng(T * 100 + chunk)
    C, B = 3, 2
    w = -np.exp(rng.normal(size=C))
    u = rng.normal(size=C)
    k, v = 2.0 * rng.normal(size=(C, B, T)), rng.normal(size=(C, B, T))
    np.testing.assert_allclose(run_wkv(w, u, k, v, chunk), naive_wkv(w, u, k, v), atol=1e-12)


def test_wkv_is_exact_for_extreme_decays_and_far_apart_chunks():
    rng = np.random.default_rng(7)
    C, B, T, chunk = 6, 2, 32, 8
    w = -np.exp(np.array([-6.0, -2.0, 0.0, 2.0, 4.0, 5.0]))  # from 0.0025 to 148 per step
    u = np.array([-3.0, 0.0, 2.0, 5.0, -1.0, 1.0])
    k = rng.uniform(-15, 15, (C, B, T))  # 30 nats within a chunk (< KEY_CLAMP) ...
    k += np.repeat([60.0, -60.0, 0.0, 80.0], chunk)  # ... and chunks far apart
    v = rng.normal(size=(C, B, T))
    expected = naive_wkv(w, u, k, v)
    for dtype, tol in ((np.float64, 1e-9), (np.float32, 2e-5)):
        with np.errstate(all="raise"):  # no overflow, no underflow, no 0/0
            got = run_wkv(*(a.astype(dtype) for a in (w, u, k, v)), chunk)
        np.testing.assert_allclose(got, expected, atol=tol * np.abs(v).max())


def test_wkv_stays_finite_and_bounded_for_absurd_keys():
    rng = np.random.default_rng(8)
    C, B, T = 4, 2, 32
    w = -np.exp(np.array([-6.0, 0.0, 3.0, 6.0]))
    u = np.array([-8.0, 0.0, 8.0, 1.0])
    k = rng.uniform(-200, 200, (C, B, T)).astype(np.float32)  # far outside a trained model
    v = rng.normal(size=(C, B, T)).astype(np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        got = run_wkv(w.astype(np.float32), u.astype(np.float32), k, v, 16)
    # wkv is a weighted mean of the values seen so far
    assert np.isfinite(got).all()
    assert (got >= v.min() - 1e-5).all() and (got <= v.max() + 1e-5).all()


def test_wkv_backward_matches_finite_differences():
    rng = np.random.default_rng(3)
    C, B, T, chunk = 2, 2, 9, 3
    w, u = -np.exp(rng.normal(size=C)), rng.normal(size=C)
    k, v = rng.normal(size=(C, B, T)), rng.normal(size=(C, B, T))
    upstream = rng.normal(size=(C, B, T))
    _, cache = wkv_forward(w, u, to_chunks(k, chunk), to_chunks(v, chunk), T // chunk)
    dk, dv, dw, du = wkv_backward(to_chunks(upstream, chunk), cache)
    analytic = {"k": from_chunks(dk, B), "v": from_chunks(dv, B), "w": dw, "u": du}
    inputs = {"k": k, "v": v, "w": w, "u": u}
    for name, x in inputs.items():
        direction = rng.normal(size=x.shape)

        def f(s, name=name, direction=direction):
            args = dict(inputs, **{name: inputs[name] + s * direction})
            out = run_wkv(args["w"], args["u"], args["k"], args["v"], chunk)
            return float((out * upstream).sum())

        numeric = (f(1e-6) - f(-1e-6)) / 2e-6
        exact = float((analytic[name] * direction).sum())
        assert abs(exact - numeric) / (abs(exact) + abs(numeric)) < 1e-7, name


# ---------------------------------------------------------------- gradients of the model

SHAPES = [
    # n_layer, n_embd, ffn_mult, chunk, B, T
    (1, 4, 1, 16, 1, 3),  # T shorter than a chunk, B = 1
    (2, 8, 2, 4, 2, 7),  # T not a multiple of the chunk
    (3, 6, 1, 4, 3, 12),  # several chunks, three blocks
    (2, 5, 4, 1, 2, 4),  # odd width, chunk of 1 (pure state recurrence)
]


@pytest.mark.parametrize("n_layer, n_embd, ffn_mult, chunk, B, T", SHAPES)
def test_every_gradient_matches_finite_differences(n_layer, n_embd, ffn_mult, chunk, B, T):
    model, flat = make_model(n_layer, n_embd, T, ffn_mult, chunk, seed=n_layer * 10 + n_embd)
    tokens = tokens_for(B, T)
    grad = model.space.zeros(np.float64)
    model.loss_and_grad(flat, tokens, grad)
    rng = np.random.default_rng(5)
    eps = 1e-5
    checked = []
    for slot in model.space:
        # directional derivative along a random direction confined to this tensor
        direction = model.space.zeros(np.float64)
        direction[slot.offset : slot.offset + slot.size] = rng.normal(size=slot.size)
        numeric = (model.loss(flat + eps * direction, tokens)
                   - model.loss(flat - eps * direction, tokens)) / (2 * eps)
        exact = float(grad @ direction)
        error = abs(exact - numeric) / max(abs(exact) + abs(numeric), 1e-12)
        assert error <= 1e-5, (slot.name, exact, numeric, error)
        assert abs(exact) > 1e-8, (slot.name, "gradient vanishes: the check would be empty")
        checked.append(slot.name)
    assert len(checked) == len(model.space) == 3 + 18 * n_layer + 3


def test_sampled_coordinates_of_every_tensor_match_finite_differences():
    model, flat = make_model(2, 6, 9, 2, 4, seed=11)
    tokens = tokens_for(2, 9, seed=4)
    grad = model.space.zeros(np.float64)
    model.loss_and_grad(flat, tokens, grad)
    rng = np.random.default_rng(6)
    eps = 1e-6
    for slot in model.space:
        for j in rng.choice(slot.size, size=min(3, slot.size), replace=False):
            i = slot.offset + j
            bump = np.zeros_like(flat)
            bump[i] = eps
            up, down = model.loss(flat + bump, tokens), model.loss(flat - bump, tokens)
            numeric = (up - down) / (2 * eps)
            error = abs(grad[i] - numeric) / max(abs(grad[i]) + abs(numeric), 1e-6)
            assert error <= 1e-5, (slot.name, j, grad[i], numeric)


# ---------------------------------------------------------------- the Model contract


def test_loss_at_init_is_near_uniform():
    model = RWKV(RWKVConfig())
    flat = model.space.zeros()
    model.init_params(flat, np.random.default_rng(0))
    loss = model.loss(flat, tokens_for(4, model.ctx_len))
    assert abs(loss - math.log(256)) < 0.3


def test_init_is_deterministic_in_the_seed():
    model = RWKV(RWKVConfig(n_layer=2, n_embd=16))
    a, b, c = model.space.zeros(), model.space.zeros(), model.space.zeros()
    model.init_params(a, np.random.default_rng(1))
    model.init_params(b, np.random.default_rng(1))
    model.init_params(c, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_loss_equals_loss_and_grad_and_logits():
    model, flat = make_model(2, 8, 10, 2, 4, dtype=np.float32)
    tokens = tokens_for(3, 10)
    grad = model.space.zeros()
    loss = model.loss_and_grad(flat, tokens, grad)
    assert loss == pytest.approx(model.loss(flat, tokens), rel=1e-6)
    logits = model.logits(flat, tokens[:, :-1])
    assert logits.shape == (3, 10, 256) and logits.dtype == np.float32
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    picked = np.take_along_axis(logp, tokens[:, 1:, None].astype(np.intp), axis=-1)
    assert -picked.mean() == pytest.approx(loss, rel=1e-5)


def test_logits_of_a_prefix_equal_the_prefix_of_the_logits():
    model, flat = make_model(2, 8, 21, 2, 4, seed=3)  # 21 = 5 chunks of 4 and a part
    inputs = tokens_for(2, 21)[:, :-1]
    full = model.logits(flat, inputs)
    for t in (1, 3, 4, 5, 8, 13, 20):
        np.testing.assert_allclose(model.logits(flat, inputs[:, :t]), full[:, :t], atol=1e-12)
    changed = inputs.copy()
    changed[:, 9] ^= 0x55  # a later token changes later logits only
    later = model.logits(flat, changed)
    np.testing.assert_allclose(later[:, :9], full[:, :9], atol=1e-12)
    assert not np.allclose(later[:, 9:], full[:, 9:])


def test_chunk_length_does_not_change_results():
    tokens = tokens_for(2, 13)
    results = []
    for chunk in (1, 4, 16):
        model, flat = make_model(2, 8, 13, 2, chunk, seed=3)
        grad = model.space.zeros(np.float64)
        loss = model.loss_and_grad(flat, tokens, grad)
        results.append((loss, grad, model.logits(flat, tokens[:, :-1])))
    for loss, grad, logits in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-12)
        np.testing.assert_allclose(grad, results[0][1], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(logits, results[0][2], rtol=1e-10, atol=1e-10)


def test_grad_is_overwritten_not_accumulated():
    model, flat = make_model(dtype=np.float32)
    tokens = tokens_for(2, 7)
    clean = model.space.zeros()
    model.loss_and_grad(flat, tokens, clean)
    dirty = np.full(model.space.size, np.nan, np.float32)
    model.loss_and_grad(flat, tokens, dirty)
    np.testing.assert_array_equal(dirty, clean)


def test_scratch_reuse_across_calls_and_shapes_changes_nothing():
    model, flat = make_model(2, 8, 8, 2, 4, dtype=np.float32)
    first, other = tokens_for(2, 8, seed=1), tokens_for(3, 5, seed=2)
    expected = model.space.zeros()
    expected_loss = RWKV(model.config).loss_and_grad(flat, first, expected)
    for batch in (first, other, first, tokens_for(1, 8), first):
        grad = model.space.zeros()
        loss = model.loss_and_grad(flat, batch, grad)
        model.loss(flat, other)
    assert loss == expected_loss
    np.testing.assert_array_equal(grad, expected)


def test_float32_agrees_with_float64():
    model, flat64 = make_model(3, 16, 32, 4, 16, seed=9)
    tokens = tokens_for(4, 32)
    flat32 = flat64.astype(np.float32)
    g64, g32 = model.space.zeros(np.float64), model.space.zeros(np.float32)
    loss64 = model.loss_and_grad(flat64, tokens, g64)
    loss32 = model.loss_and_grad(flat32, tokens, g32)
    assert loss32 == pytest.approx(loss64, rel=1e-5)
    np.testing.assert_allclose(
        model.logits(flat32, tokens[:, :-1]), model.logits(flat64, tokens[:, :-1]), atol=2e-4
    )
    assert np.linalg.norm(g32 - g64) < 1e-4 * np.linalg.norm(g64)


def test_arch_flops_and_memory_figures():
    config = RWKVConfig()
    model = RWKV(config)
    assert model.name == "rwkv" and model.vocab_size == 256 and model.ctx_len == config.ctx_len
    arch = model.arch()
    assert arch["model"] == "rwkv"
    assert RWKVConfig(**{k: v for k, v in arch.items() if k != "model"}) == config
    C, F, L = config.n_embd, config.ffn_mult * config.n_embd, config.n_layer
    matrices = L * (5 * C * C + 2 * C * F) + C * 256
    assert model.flops_per_token() == 6 * matrices + 12 * (config.wkv_chunk + 1) * C * L
    assert model.space.n_params == matrices + 256 * C + 2 * C + L * 11 * C + 2 * C
    assert 0 < model.activation_bytes_per_sample() < 10**8


def test_rejects_bad_sizes_and_buffers():
    with pytest.raises(ValueError):
        RWKV(RWKVConfig(n_embd=0))
    model, flat = make_model(dtype=np.float32)
    with pytest.raises(ValueError):
        model.loss(flat[:-1].copy(), tokens_for(1, 4))
    with pytest.raises(ValueError):
        model.loss_and_grad(flat, tokens_for(1, 4), model.space.zeros(np.float64))


def test_an_arch_with_a_million_blocks_is_refused_before_it_is_built():
    """A checkpoint's, an HF directory's or a base's arch is a file's word: n_layer 10^6 kept
    `sample`, `join --base` busy for minutes and 3.7-4.3 GB before any size check."""
    from p2ptrain.models import model_from_arch
    from p2ptrain.models.rwkv import MAX_LAYERS

    with pytest.raises(ValueError, match=f"n_layer 1000000 is above {MAX_LAYERS}"):
        model_from_arch({"model": "rwkv", "n_layer": 10**6, "n_embd": 8, "ctx_len": 4})
    assert model_from_arch({"model": "rwkv", "n_layer": 24, "n_embd": 8, "ctx_len": 4})
