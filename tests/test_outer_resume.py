"""The outer optimiser's state in checkpoints: a node that resumes from its own checkpoint
keeps the round's progress and what it still owes (exactly: the stored bits are adopted);
another node's checkpoint, a checkpoint of another kind of outer state, or one whose state
is not finite leaves it at zero."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain import checkpoint
from p2ptrain.identity import load_or_create
from p2ptrain.outerstate import state_arrays
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.trainer import GossipTrainer
from tests.test_node import learner


def trainer_of(node_id: str, **gossip) -> GossipTrainer:
    config = GossipConfig(**({"outer_every": 4, "fanout": 1} | gossip))
    return GossipTrainer(config, learner(node_id), np.random.default_rng(5),
                         average_timeout=90.0, chunk_elems=1 << 12)


def saved_outer(tmp_path, **gossip):
    """A node with outer steps, three steps into a round, owing something; its checkpoint."""
    ident = load_or_create(tmp_path / "id")
    t = trainer_of(ident.node_id, **gossip)
    for _ in range(3):
        t.learner.train_step()  # the optimiser adds each step's move to the round's progress
    owed = np.random.default_rng(2).normal(0, 1e-3, t.n).astype(np.float32)
    t.outer.feedback.write(0, t.n, owed)
    path = checkpoint.save(tmp_path / "ck", t.learner.snapshot(term=1), ident, keep=2)
    return ident, t, path


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("rewind", [True, False])
def test_a_node_resuming_from_its_own_checkpoint_keeps_its_outer_state(tmp_path, bits, rewind):
    ident, before, path = saved_outer(tmp_path, outer_feedback_bits=bits, outer_rewind=rewind)
    assert before.outer.progress.any() and before.outer.feedback.any()
    resumed = learner(ident.node_id)
    resumed.restore(path, checkpoint.read_manifest(path))
    assert resumed.outer_saved is not None  # read with the rest of the state
    config = GossipConfig(outer_every=4, fanout=1, outer_feedback_bits=bits,
                          outer_rewind=rewind)
    t = GossipTrainer(config, resumed, np.random.default_rng(5), average_timeout=90.0,
                      chunk_elems=1 << 12)
    assert t.outer.restored and resumed.outer_saved is None  # taken once
    np.testing.assert_array_equal(t.outer.feedback.values(), before.outer.feedback.values())
    np.testing.assert_array_equal(t.outer.progress.values(), before.outer.progress.values())
    assert resumed.progress is t.outer.progress and resumed.step == 3


def test_other_nodes_and_other_kinds_of_state_start_at_zero(tmp_path):
    ident, before, path = saved_outer(tmp_path)
    manifest = checkpoint.read_manifest(path)
    stranger = learner("f" * 32)  # a joiner adopting the leader's checkpoint
    stranger.restore(path, manifest)
    assert stranger.outer_saved is None
    other_kind = learner(ident.node_id)  # the node restarted with 16-bit feedback
    other_kind.restore(path, manifest)
    t = GossipTrainer(GossipConfig(outer_every=4, fanout=1, outer_feedback_bits=16),
                      other_kind, np.random.default_rng(5), average_timeout=90.0,
                      chunk_elems=1 << 12)
    assert not t.outer.restored and not t.outer.feedback.any() and not t.outer.progress.any()
    plain = learner(ident.node_id)  # outer steps off now: the state read is let go
    plain.restore(path, manifest)
    assert GossipTrainer(GossipConfig(), plain, np.random.default_rng(5), average_timeout=90.0,
                         chunk_elems=1 << 12).outer is None
    assert plain.outer_saved is None


def test_a_state_that_is_not_finite_or_does_not_fit_is_refused(tmp_path):
    _, before, _ = saved_outer(tmp_path)
    meta, arrays = before.outer.state()
    good = {name: a.copy() for name, a in arrays}
    fresh = trainer_of("e" * 32).outer
    nan_bits = dict(good, **{"outer.progress.bits": good["outer.progress.bits"].copy()})
    nan_bits["outer.progress.bits"][7] = 0x7FC0  # a bfloat16 NaN
    bad_scale = dict(good, **{"outer.feedback.scales": good["outer.feedback.scales"].copy()})
    bad_scale["outer.feedback.scales"][0] = -1.0
    short = dict(good, **{"outer.feedback.codes": good["outer.feedback.codes"][:-1]})
    # finite but absurd: a scale whose codes decode to infinity, progress of 3.4e38
    huge_scale = dict(good, **{"outer.feedback.scales": good["outer.feedback.scales"].copy()})
    huge_scale["outer.feedback.scales"][0] = 3e38
    huge_bits = dict(good, **{"outer.progress.bits": good["outer.progress.bits"].copy()})
    huge_bits["outer.progress.bits"][3] = 0x7F7F  # bfloat16's largest finite value
    for arrays in (nan_bits, bad_scale, short, {}, huge_scale, huge_bits):
        assert not fresh.restore({"meta": meta, "arrays": arrays})
        assert not fresh.progress.any() and not fresh.feedback.any()
    assert not fresh.restore({"meta": dict(meta, n=meta["n"] + 1), "arrays": good})
    assert state_arrays({"bits": 8, "rewind": True, "n": 10**12}, meta["n"]) is None
    assert state_arrays("junk", meta["n"]) is None
    assert fresh.restore({"meta": meta, "arrays": good})
    np.testing.assert_array_equal(fresh.feedback.values(), before.outer.feedback.values())


def test_a_trainer_rebuilt_mid_round_takes_the_old_ones_outer_state_over(tmp_path):
    """Becoming outbound-only builds a new node, so a new trainer, over the same learner:
    the round's progress and what it owes must go along (the runtime hands them over), or
    the steps before the switch are never shared nor rewound."""
    _, before, _ = saved_outer(tmp_path)
    progress, owed = before.outer.progress.values(), before.outer.feedback.values()
    assert progress.any() and owed.any()
    before.learner.outer_saved = before.outer.handover()  # what the runtime does
    after = GossipTrainer(before.config, before.learner, np.random.default_rng(6),
                          average_timeout=90.0, chunk_elems=1 << 12)
    assert after.outer.restored
    np.testing.assert_array_equal(after.outer.progress.values(), progress)
    np.testing.assert_array_equal(after.outer.feedback.values(), owed)


def test_a_replica_replaced_by_a_fetched_checkpoint_forgets_its_outer_round(tmp_path):
    """Adopting the leader's checkpoint (Node._adopt_counts: close(replaced=True)): the old
    replica's round must not be rewound from, nor its debt shared, on the adopted weights."""
    _, t, _ = saved_outer(tmp_path)
    t.close()  # stopping keeps it (a final checkpoint may carry it)
    assert t.outer.progress.values().any() and t.outer.feedback.values().any()
    t.close(replaced=True)
    assert not t.outer.progress.values().any() and not t.outer.feedback.values().any()
