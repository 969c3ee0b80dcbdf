"""LoRA mode's model: adapter gradients against finite differences (also with the head
adapted and the frozen matrices widened in several column blocks), base + adapters equal to
the merged full model, the base file never written, and base directories checked."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from p2ptrain.lora.basefile import (
    BaseError,
    make_base,
    read_base,
    verify_base,
    write_base,
)
from p2ptrain.models.lora import LoRAConfig, LoRARWKV, adapted_names
from p2ptrain.models.rwkv import RWKV, RWKVConfig


def full_model(n_layer=2, n_embd=8, ctx_len=7, ffn_mult=2, wkv_chunk=4, seed=0):
    """A full model with every weight random (no zero matrices to hide a missing term)."""
    model = RWKV(RWKVConfig(n_layer=n_layer, n_embd=n_embd, ctx_len=ctx_len,
                            ffn_mult=ffn_mult, wkv_chunk=wkv_chunk))
    rng = np.random.default_rng(seed)
    flat = model.space.zeros()
    model.init_params(flat, rng)
    views = model.space.views(flat)
    for slot in model.space:
        if slot.name.endswith("time_decay"):
            views[slot.name][...] = rng.uniform(-2.0, 1.0, slot.shape)
        else:
            views[slot.name] += rng.normal(0.0, 0.3, slot.shape).astype(np.float32)
    return model, flat


SMALL = LoRAConfig(rank=3, alpha=6.0)


def lora_on(tmp_path, dtype="fp32", lora=SMALL, seed=0, **shape):
    full, flat = full_model(seed=seed, **shape)
    base = write_base(full, full.space.views(flat), tmp_path / "bases", dtype)
    model = LoRARWKV(full.config, lora, base.frozen(full), base.id)
    return model, full, flat, base


def random_adapters(model, seed=3, dtype=np.float64):
    """Adapters with B away from zero (at init B = 0 hides A's gradient)."""
    flat = model.space.zeros(dtype)
    flat[:] = np.random.default_rng(seed).normal(0.0, 0.2, flat.shape)
    for lo, hi in model._padding:
        flat[lo:hi] = 0.0
    return flat


def tokens_for(B, T, seed=1):
    return np.random.default_rng(seed).integers(0, 256, (B, T + 1)).astype(np.uint8)


def check_gradients(model, flat, tokens, eps=1e-5):
    grad = model.space.zeros(np.float64)
    model.loss_and_grad(flat, tokens, grad)
    rng = np.random.default_rng(5)
    for slot in model.space:
        direction = model.space.zeros(np.float64)
        direction[slot.offset : slot.offset + slot.size] = rng.normal(size=slot.size)
        numeric = (model.loss(flat + eps * direction, tokens)
                   - model.loss(flat - eps * direction, tokens)) / (2 * eps)
        exact = float(grad @ direction)
        error = abs(exact - numeric) / max(abs(exact) + abs(numeric), 1e-12)
        assert error <= 1e-5, (slot.name, exact, numeric, error)
        assert abs(exact) > 1e-8, (slot.name, "gradient vanishes: the check would be empty")
    return grad


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_adapter_gradients_match_finite_differences(tmp_path, dtype):
    model, *_ = lora_on(tmp_path, dtype)
    assert len(model.space) == 2 * 7 * 2  # A and B of 7 matrices in each of 2 blocks
    check_gradients(model, random_adapters(model), tokens_for(2, 7))


def test_head_adapter_and_blocked_widening_match_finite_differences(tmp_path):
    lora = LoRAConfig(rank=2, alpha=3.0, targets="blocks.*.att.output,blocks.1.ffn.*,head")
    model, *_ = lora_on(tmp_path, "bf16", lora, n_layer=2, n_embd=8, ffn_mult=2)
    assert sorted(model.adapted) == ["blocks.0.att.output", "blocks.1.att.output",
                                     "blocks.1.ffn.key", "blocks.1.ffn.receptance",
                                     "blocks.1.ffn.value", "head"]
    model._block_elems = 8 * 5  # every matrix in column blocks of 5 (and a remainder)
    flat = random_adapters(model, seed=9)
    grad = check_gradients(model, flat, tokens_for(3, 7, seed=2))
    model._row_block_min = 2  # backward in row blocks (of 2 or 5 rows) where they fit
    check_gradients(model, flat, tokens_for(3, 7, seed=2))
    model._block_elems = 10**6  # one block each: the same numbers
    again = model.space.zeros(np.float64)
    model.loss_and_grad(flat, tokens_for(3, 7, seed=2), again)
    np.testing.assert_allclose(again, grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-5), ("bf16", 1e-5), ("fp16", 1e-5)])
def test_merged_weights_give_the_same_logits(tmp_path, dtype, tol):
    """Merged in float32 from the same 16-bit base: the products differ only by float32
    rounding. (A merged model stored back in 16 bits would round W + s A B once more: about
    2^-8 relative for bf16, 2^-11 for fp16 -- the tolerance a 16-bit export has.)"""
    model, full, _, _ = lora_on(tmp_path, dtype)
    adapters = random_adapters(model, dtype=np.float32)
    merged = model.merge(adapters, full.space.zeros())
    tokens = tokens_for(2, 7)[:, :-1]
    lora_logits = model.logits(adapters, tokens)
    full_logits = full.logits(merged, tokens)
    assert np.abs(lora_logits - full_logits).max() <= tol * max(1.0, np.abs(full_logits).max())
    # float64 throughout: equal to rounding
    merged64 = model.merge(adapters.astype(np.float64), full.space.zeros(np.float64))
    np.testing.assert_allclose(model.logits(adapters.astype(np.float64), tokens),
                               full.logits(merged64, tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype, tol", [("bf16", 0.05), ("fp16", 0.01)])
def test_merged_weights_stored_in_16_bits_stay_within_the_stated_tolerance(tmp_path, dtype,
                                                                           tol):
    """Merged weights narrowed back to 16 bits (e.g. the base of the next round) round
    W + s A B once more (2^-9 relative for bf16, 2^-12 for fp16): logits move by at most
    `tol` times their largest magnitude -- the tolerance stated for 16-bit merged weights."""
    model, full, _, _ = lora_on(tmp_path, dtype)
    adapters = random_adapters(model, dtype=np.float32)
    merged = model.merge(adapters, full.space.zeros())
    again = write_base(full, full.space.views(merged), tmp_path / "next", dtype)
    narrowed = again.frozen(full)
    weights = full.space.zeros()
    for slot in full.space:
        np.copyto(full.space.view(weights, slot.name), narrowed.widened(slot.name))
    tokens = tokens_for(2, 7)[:, :-1]
    exact = model.logits(adapters, tokens)
    err = np.abs(full.logits(weights, tokens) - exact).max() / np.abs(exact).max()
    assert 0 < err <= tol, err


def test_fresh_adapters_compute_the_base(tmp_path):
    model, full, flat, _ = lora_on(tmp_path, "fp32")
    adapters = model.space.zeros()
    model.init_params(adapters, np.random.default_rng(0))
    assert np.abs(adapters).max() > 0  # A is drawn, B is zero
    tokens = tokens_for(2, 7)
    assert model.loss(adapters, tokens) == pytest.approx(full.loss(flat, tokens), rel=1e-6)


def test_training_the_adapters_never_writes_the_base(tmp_path):
    model, _, _, base = lora_on(tmp_path, "bf16")
    path = base.path / "base.safetensors"
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    adapters = random_adapters(model, dtype=np.float32)
    grad = model.space.zeros()
    tokens = tokens_for(2, 7)
    first = model.loss_and_grad(adapters, tokens, grad)
    for _ in range(20):
        model.loss_and_grad(adapters, tokens, grad)
        adapters -= 0.05 * grad
    assert model.loss(adapters, tokens) < first
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert not model.base.tensors["head"].flags.writeable


def test_adapter_size_is_20_r_C_per_block(tmp_path):
    model, full, _, _ = lora_on(tmp_path, "bf16", LoRAConfig(rank=4), n_layer=2, n_embd=16,
                                ffn_mult=4)
    C, r, layers = 16, 4, 2
    assert model.space.n_params == 20 * r * C * layers
    block_matrices = 13 * C * C * layers  # 4C^2 + C^2 + 2 * 4C^2 per block
    assert sum(full.space.slot(n).size for n in model.adapted) == block_matrices
    assert model.arch()["lora"] == {"rank": 4, "alpha": 32.0,
                                    "targets": "blocks.*.att.*,blocks.*.ffn.*",
                                    "base": model.base_id}


def test_targets_that_name_nothing_are_refused(tmp_path):
    full, _ = full_model()
    with pytest.raises(ValueError, match="names no matrix"):
        adapted_names(full.space, "blocks.*.att.kee")
    with pytest.raises(ValueError, match="names no matrix"):
        adapted_names(full.space, "emb")  # a lookup table takes no adapter


def test_base_directories_are_named_by_content_and_checked(tmp_path):
    full, flat = full_model()
    a = write_base(full, full.space.views(flat), tmp_path, "bf16")
    again = write_base(full, full.space.views(flat), tmp_path, "bf16")
    assert a.id == again.id and a.path == again.path == tmp_path / a.id
    assert write_base(full, full.space.views(flat), tmp_path, "fp16").id != a.id
    assert make_base(a.path, tmp_path / "other").id == a.id  # a base dir is taken as it is
    verify_base(a)
    data = bytearray((a.path / "base.safetensors").read_bytes())
    data[-3] ^= 0x40  # a flipped bit in the last chunk
    (a.path / "base.safetensors").write_bytes(bytes(data))
    with pytest.raises(BaseError, match="chunk .* is damaged"):
        verify_base(read_base(a.path))
    (a.path / "base.json").write_text('{"format": "p2ptrain-base/1"}')
    with pytest.raises(BaseError, match="exactly format"):
        read_base(a.path)
    other = RWKV(RWKVConfig(n_layer=1, n_embd=8, ffn_mult=2))
    with pytest.raises(BaseError, match="not a base of this model"):
        write_base(full, full.space.views(flat), tmp_path / "b", "bf16").frozen(other)


def test_non_finite_weights_make_no_base(tmp_path):
    full, flat = full_model()
    flat[5] = np.nan
    with pytest.raises(BaseError, match="NaN"):
        write_base(full, full.space.views(flat), tmp_path, "bf16")
    flat[5] = 1e6
    with pytest.raises(BaseError, match="fp16's range"):
        write_base(full, full.space.views(flat), tmp_path, "fp16")
    assert not any(tmp_path.iterdir())  # nothing half-written left


def test_a_base_from_a_hugging_face_directory_holds_its_weights(tmp_path):
    """`--base HF_DIR` (or --init-from in LoRA mode): our layout, narrowed to bf16, with the
    directory's tokenizer; the same weights as a base made from the full model directly."""
    from p2ptrain.models.hf import export_hf

    full, flat = full_model()
    export_hf(full, flat, tmp_path / "hf")
    from_hf = make_base(tmp_path / "hf", tmp_path / "bases", "bf16")
    direct = write_base(full, full.space.views(flat), tmp_path / "direct", "bf16")
    assert from_hf.shape == direct.shape
    a, b = from_hf.frozen(full), direct.frozen(full)
    for slot in full.space:
        np.testing.assert_array_equal(a.tensors[slot.name], b.tensors[slot.name])
    # the byte-level tokenizer.json export writes means bytes: byte corpora train on it
    assert from_hf.tokenizer_id == "bytes" and from_hf.tokenizer_json() is None
    assert make_base(tmp_path / "hf", tmp_path / "bases").id == from_hf.id  # kept, not redone


def test_a_base_is_made_once_per_source_and_again_when_it_changes(tmp_path, monkeypatch):
    from p2ptrain.lora import setup
    from p2ptrain.models.hf import export_hf

    full, flat = full_model()
    export_hf(full, flat, tmp_path / "hf")
    made = []
    real = setup.make_base
    monkeypatch.setattr(setup, "make_base", lambda *a: made.append(a) or real(*a))
    first = setup.resolve_base(str(tmp_path / "hf"), tmp_path / "state")
    again = setup.resolve_base(str(tmp_path / "hf"), tmp_path / "state")
    assert first.id == again.id and len(made) == 1  # the second start reads the index
    flat[3] += 1.0
    (tmp_path / "hf" / "model.safetensors").unlink()
    export_hf(full, flat, tmp_path / "hf2")
    (tmp_path / "hf2" / "model.safetensors").rename(tmp_path / "hf" / "model.safetensors")
    changed = setup.resolve_base(str(tmp_path / "hf"), tmp_path / "state")
    assert len(made) == 2 and changed.id != first.id
    assert setup.resolve_base(first.id, tmp_path / "state").id == first.id  # by id
    index = next((tmp_path / "state").rglob(setup.SOURCES))
    index.write_text("[" * 100_000)  # nested past the recursion limit: it was a traceback
    assert setup.resolve_base(str(tmp_path / "hf"), tmp_path / "state").id == changed.id
    assert len(made) == 3  # made again: the index is only a shortcut
