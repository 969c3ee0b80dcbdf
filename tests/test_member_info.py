"""How a node describes itself to the swarm (p2ptrain.startup.member_info): members whose
averaging exchanges would not match are told apart by their configuration fingerprint and
refused naming `averaging`, instead of each refusing the other's parts as the wrong length
and counting it an offender."""

from __future__ import annotations

import pytest

from p2ptrain.data import load_corpus
from p2ptrain.learner import Learner
from p2ptrain.models import build_model
from p2ptrain.models.mlp import MLPConfig
from p2ptrain.proto import differing_keys
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.gossip.plan import AveragingPlan
from p2ptrain.settings import TrainConfig
from p2ptrain.startup import member_info

MODEL = build_model("mlp", MLPConfig(n_hidden=32, n_embd=8, ctx_len=16))
CORPUS = load_corpus(None, 0.1, 20)
HW = type("HW", (), {"device_class": "desktop", "matmul_gflops": 1.0})()


def info(gossip: GossipConfig, node_id: str = "a" * 32, train: TrainConfig | None = None):
    learner = Learner(MODEL, node_id, train or TrainConfig(), CORPUS, batch=4, accum=1,
                      eval_count=4)
    return member_info(learner, HW, "127.0.0.1:1", 0, False, gossip)


def test_the_wire_shape_names_what_an_exchange_is_made_of():
    n = 10_000_000
    assert AveragingPlan.from_mode(n, "int8").wire_shape() == "int8 all runs 256 part 2097152"
    assert AveragingPlan.from_mode(n, "subset_fp16", 0.2, 1 << 20).wire_shape() == \
        "fp16 0.2 runs 256 part 1048576"
    assert AveragingPlan.from_mode(n, "subset_int8", 0.093, slow_fraction=0.0085
                                   ).wire_shape() == "int8 0.093/0.0085 runs 256 part whole"
    # a part is rounded up to whole runs, as it travels
    assert AveragingPlan.from_mode(n, "full", part=1000).wire_shape() == \
        "fp32 all runs 256 part 1024"
    # parts as long as the widest exchange or longer all travel as one: they match
    assert AveragingPlan.from_mode(n, "full", part=n).wire_shape() == \
        AveragingPlan.from_mode(n, "full", part=2 * n).wire_shape() == \
        "fp32 all runs 256 part whole"


@pytest.mark.parametrize("theirs", [
    GossipConfig(subset_fraction=0.2),
    GossipConfig(subset_fraction_slow=0.01),
    GossipConfig(averaging="subset_fp16"),
    GossipConfig(averaging="int8"),
])
def test_members_whose_exchanges_would_not_match_differ_in_averaging_alone(theirs):
    mine = info(GossipConfig())
    other = info(theirs, "b" * 32)
    assert mine.fingerprint != other.fingerprint
    assert differing_keys(mine.fingerprint_fields, other.fingerprint_fields) == ["averaging"]


@pytest.mark.parametrize("theirs", [
    GossipConfig(fanout=2, codec="int8"),
    GossipConfig(fanout=2, fraction=0.05),
    GossipConfig(fanout=2, outer_every=20),
])
def test_members_whose_gradients_would_be_refused_differ_in_gradients_alone(theirs):
    """A push in another codec (or with other parameters), or pseudo-gradients among
    gradients, would be refused chunk by chunk at step rate: refused as a member instead."""
    mine = info(GossipConfig(fanout=2))
    other = info(theirs, "b" * 32)
    assert mine.fingerprint != other.fingerprint
    assert differing_keys(mine.fingerprint_fields, other.fingerprint_fields) == ["gradients"]


def test_a_part_size_counts_where_it_splits_an_exchange():
    """The test model's exchanges are shorter than a part: any part size as long matches;
    one that splits them does not."""
    n = MODEL.space.n_params
    mine = info(GossipConfig(averaging="full"))
    assert info(GossipConfig(averaging="full", average_part=8 * n)).fingerprint == \
        mine.fingerprint
    split = info(GossipConfig(averaging="full", average_part=1024), "b" * 32)
    assert n > 1024 and split.fingerprint != mine.fingerprint
    assert differing_keys(mine.fingerprint_fields, split.fingerprint_fields) == ["averaging"]


def test_settings_that_leave_the_exchange_alone_keep_the_fingerprint():
    """Cadence, partner choice and guards may differ per member: their exchanges match."""
    mine = info(GossipConfig())
    other = info(GossipConfig(average_every=10, average_pull_max=0.5, average_explore=0.5,
                              fanout=2, distance_multiple=4.0), "b" * 32,
                 TrainConfig(ema=0.99))
    assert mine.fingerprint == other.fingerprint
    assert mine.fingerprint_fields == other.fingerprint_fields
    # auto resolves alike on every member (the same model): it matches its resolution
    assert info(GossipConfig(averaging="subset_int8")).fingerprint == mine.fingerprint

