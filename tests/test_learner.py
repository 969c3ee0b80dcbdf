import dataclasses

import numpy as np
import pytest

from p2ptrain import checkpoint
from p2ptrain import learner as learner_module
from p2ptrain.config import ConfigError, resolve, settings_of
from p2ptrain.data import load_corpus
from p2ptrain.identity import load_or_create
from p2ptrain.learner import Learner, ema_decay
from p2ptrain.models import build_model
from p2ptrain.models.mlp import MLPConfig


def make(node_id="n1", **train_overrides):
    cfg = resolve(None, {}, {})
    train = dataclasses.replace(settings_of(cfg).train, warmup_samples=8,
                                **train_overrides)
    model = build_model("mlp", MLPConfig(n_hidden=32, n_embd=8, ctx_len=16))
    corpus = load_corpus(None, 0.1, 20)
    return Learner(model, node_id, train, corpus, batch=8, accum=1, eval_count=16)


def test_training_lowers_the_held_out_loss():
    learner = make()
    before = learner.evaluate()
    for _ in range(150):
        learner.train_step()
    after = learner.evaluate()
    assert before > 5.0 and after < before - 1.5
    assert learner.swarm_samples == 150 * 8 == learner.samples


def test_accumulation_equals_one_big_batch():
    a, b = make(), make()
    b.accum = 4
    b._micro_grad = b.model.space.zeros()
    for _ in range(3):
        a.train_step()
        b.train_step()
    np.testing.assert_allclose(a.params, b.params, rtol=1e-4, atol=1e-6)


def test_resume_from_a_checkpoint_continues_exactly(tmp_path):
    ident = load_or_create(tmp_path)
    straight = make(ident.node_id)
    for _ in range(6):
        straight.train_step()
    first = make(ident.node_id)
    for _ in range(3):
        first.train_step()
    path = checkpoint.save(tmp_path / "ck", first.snapshot(term=0), ident, keep=2)
    resumed = make(ident.node_id)
    resumed.restore(path, checkpoint.read_manifest(path))
    assert resumed.step == 3 and resumed.swarm_samples == 24
    for _ in range(3):
        resumed.train_step()
    np.testing.assert_array_equal(resumed.params, straight.params)
    np.testing.assert_array_equal(resumed.opt.v, straight.opt.v)


def test_run_finishes_at_total_samples():
    learner = make(total_samples=20)
    steps = 0
    while not learner.finished:
        learner.train_step()
        steps += 1
    assert steps == 3 and learner.swarm_samples == 24


def test_with_ema_checkpoints_carry_the_average_of_the_weights_over_steps(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(learner_module, "AVERAGE_CHUNK", 100)  # several chunks, a short last
    ident = load_or_create(tmp_path)
    plain, averaged = make(ident.node_id), make(ident.node_id, ema=0.75)
    assert averaged.params.size > 100 and averaged.params.size % 100
    weights = []
    for _ in range(3):
        plain.train_step()
        averaged.train_step()
        weights.append(averaged.params.copy())
    np.testing.assert_array_equal(plain.params, averaged.params)  # training is unchanged
    assert plain.average is None and plain.checkpoint_weights is plain.params
    d1, d2 = 2 / 11, 3 / 12  # the warm-up: (1 + n) / (10 + n) below 0.75 for n steps in it
    expected = d2 * (d1 * weights[0] + (1 - d1) * weights[1]) + (1 - d2) * weights[2]
    assert (ema_decay(0.75, 1), ema_decay(0.75, 2), ema_decay(0.75, 50)) == (d1, d2, 0.75)
    np.testing.assert_allclose(averaged.average, expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(averaged.average, averaged.params)
    path = checkpoint.save(tmp_path / "ck", averaged.snapshot(term=0), ident, keep=2)
    saved = averaged.model.space.zeros()
    checkpoint.load_tensors(path, checkpoint.MODEL_FILE, averaged.model.space.views(saved))
    np.testing.assert_array_equal(saved, averaged.average)
    other = make("another-node", ema=0.75)  # another's checkpoint: its model is the weights
    other.restore(path, checkpoint.read_manifest(path))
    np.testing.assert_array_equal(other.params, averaged.average)
    assert other.average is None  # started again from the loaded weights at the next step
    other.train_step()
    np.testing.assert_array_equal(other.average, other.params)
    adopted = make(ident.node_id, ema=0.75)  # adopting it (no state): the same
    adopted.restore(path, checkpoint.read_manifest(path), with_state=False)
    np.testing.assert_array_equal(adopted.params, averaged.average)
    assert adopted.average is None
    plain_now = make(ident.node_id)  # our own, train.ema off now: the trained weights
    plain_now.restore(path, checkpoint.read_manifest(path))
    np.testing.assert_array_equal(plain_now.params, averaged.params)
    assert plain_now.average is None


def test_with_ema_a_resume_from_our_own_checkpoint_continues_exactly(tmp_path):
    ident = load_or_create(tmp_path)
    straight = make(ident.node_id, ema=0.9)
    for _ in range(6):
        straight.train_step()
    first = make(ident.node_id, ema=0.9)
    for _ in range(3):
        first.train_step()
    path = checkpoint.save(tmp_path / "ck", first.snapshot(term=0), ident, keep=2)
    resumed = make(ident.node_id, ema=0.9)
    resumed.restore(path, checkpoint.read_manifest(path))
    np.testing.assert_array_equal(resumed.params, first.params)  # trained, not the average
    np.testing.assert_array_equal(resumed.average, first.average)
    assert resumed.averaged == first.averaged == 3
    for _ in range(3):
        resumed.train_step()
    np.testing.assert_array_equal(resumed.params, straight.params)
    np.testing.assert_array_equal(resumed.average, straight.average)


def test_lora_mode_averages_the_weights_unless_told_otherwise(tmp_path):
    """Unset, train.ema is 0.99 in LoRA mode and off in full training (and
    gossip.average_fast_share 1 and 0.5); any source that sets it wins, 0 included, and
    `config show` says where it came from."""
    from p2ptrain.learner import LORA_EMA

    lora = resolve(None, {}, {"train.mode": "lora"})
    assert lora.values["train.ema"] == LORA_EMA == 0.99
    assert lora.sources["train.ema"] == "default in LoRA mode"
    assert resolve(None, {}, {}).values["train.ema"] == 0.0
    # the fastest members' extra exchanges (gossip.average_every_fast, 1 in both modes): in
    # LoRA mode whatever share of the members the fastest are, else only for a fast core
    assert lora.values["gossip.average_fast_share"] == 1.0
    assert lora.sources["gossip.average_fast_share"] == "default in LoRA mode"
    assert resolve(None, {}, {}).values["gossip.average_fast_share"] == 0.5
    assert lora.values["gossip.average_every_fast"] == 1
    assert resolve(None, {}, {}).values["gossip.average_every_fast"] == 1
    assert resolve(None, {"P2PTRAIN_GOSSIP_AVERAGE_FAST_SHARE": "0.25"},
                   {"train.mode": "lora"}).values["gossip.average_fast_share"] == 0.25
    assert resolve(None, {"P2PTRAIN_TRAIN_EMA": "0"},
                   {"train.mode": "lora"}).values["train.ema"] == 0.0
    toml = tmp_path / "c.toml"
    toml.write_text('[train]\nmode = "lora"\nema = 0.95\n')
    assert resolve(str(toml), {}, {}).values["train.ema"] == 0.95
    # a joiner adopting a LoRA swarm's configuration takes the swarm's value, whatever it is
    adopted = resolve(None, {}, {}, adopted={"train.mode": "lora", "train.ema": 0.0})
    assert adopted.values["train.ema"] == 0.0


def test_ema_must_be_below_one():
    assert settings_of(resolve(None, {}, {"train.ema": 0.99})).train.ema == 0.99
    for bad in (1.0, 1.5):
        with pytest.raises(ConfigError, match="train.ema must be below 1"):
            resolve(None, {}, {"train.ema": bad})
    with pytest.raises(ConfigError):
        resolve(None, {}, {"train.ema": -0.1})
    with pytest.raises(ValueError, match="train.ema"):
        make(ema=1.0)  # a TrainConfig built directly (the simulator's) is checked too


def test_a_snapshot_taken_while_the_next_step_draws_its_batch_records_the_applied_position():
    """The networked node snapshots on its loop while the step thread draws the next batch:
    the checkpoint used to record the sampler's live position, so a resume skipped a batch
    never trained on."""
    lr = make()
    lr.train_step()
    applied = lr.sampler.position()
    lr.compute_gradient()  # the next step's batch is drawn, not applied yet
    assert lr.sampler.position() != applied
    assert lr.snapshot(term=0).state_meta["data"] == applied
    lr.apply_gradient(lr.grad, 1.0)
    assert lr.snapshot(term=0).state_meta["data"] == lr.sampler.position()


@pytest.mark.parametrize("spoil, message", [
    (lambda s: setattr(s.opt, "t", -3), "resume data out of range"),  # math domain error
    (lambda s: setattr(s, "samples", -7), "resume data out of range"),
    (lambda s: s.opt.v.__setitem__(5, -1.0), "negative variance"),  # "diverged: lower lr"
    (lambda s: s.opt.m.__setitem__(5, np.nan), "moments not finite"),
])
def test_resume_data_out_of_range_is_a_checkpoint_error_naming_it(tmp_path, spoil, message):
    """A state file that parsed but held a negative count or broken moments gave a traceback
    at the first step, or a run 'diverged' with advice to lower the learning rate, at every
    restart."""
    ident = load_or_create(tmp_path)
    first = make(ident.node_id)
    for _ in range(3):
        first.train_step()
    spoil(first)
    path = checkpoint.save(tmp_path / "ck", first.snapshot(term=0), ident, keep=2)
    resumed = make(ident.node_id)
    with pytest.raises(checkpoint.CheckpointError, match=f"{path.name}: .*{message}"):
        resumed.restore(path, checkpoint.read_manifest(path))
    assert resumed.step == 0 and not resumed.opt.v.any()  # nothing half-loaded
