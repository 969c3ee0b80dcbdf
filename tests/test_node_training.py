"""Issue 4's training test: 8 Nodes train a small rwkv in virtual time through the harness --
real numpy gradients, the real control plane, every message through the wire encoding and a
10 Mbit/s network -- and reach a held-out loss, judged on the *worst* replica, within 5% of
one node training on 8x the batch for the same total samples. Twice: with DESIGN's gradient
gossip switched on (topk 1% + error feedback to 2 peers, full push-pull averaging every 10
steps: every node must use gradients from at least 2 peers) and with the shipped defaults
(pure averaging of 10% of the coordinates in int8 every 5 steps, chosen with the simulator).
In both the consensus distance stays bounded, and the same run without communication
(fanout=0, average_every=0) drifts at least 10x farther apart. About four minutes on 2 cores."""

from __future__ import annotations

import pytest

from p2ptrain.data import load_corpus
from p2ptrain.learner import Learner
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.proto.gossip.averaging import consensus_distance
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.node import NodeConfig
from p2ptrain.settings import TrainConfig
from tests.cluster.harness import Network
from tests.cluster.training import TrainingCluster

NODES, BATCH, ROUNDS = 8, 16, 750
TOTAL = NODES * BATCH * ROUNDS  # swarm samples of the whole run (96,000)
EVAL_WINDOWS = 512
MODEL = RWKV(RWKVConfig(n_layer=1, n_embd=32, ctx_len=32))
TRAIN = TrainConfig(lr=4e-3, warmup_samples=TOTAL // 20, total_samples=TOTAL)
STEP_SECONDS = [0.05 * (1 + i / 14) for i in range(NODES)]  # the slowest is 1.5x the fastest


def make_learner(corpus, node_id: str, batch: int) -> Learner:
    return Learner(MODEL, node_id, TRAIN, corpus, batch, 1, EVAL_WINDOWS)


def run_swarm(corpus, gossip: GossipConfig) -> tuple[TrainingCluster, list[float]]:
    cluster = TrainingCluster(
        NODES, 1, lambda i, node_id: make_learner(corpus, node_id, BATCH),
        node_config=NodeConfig(gossip=gossip, min_peers=NODES - 1, join_fetch=False),
        step_seconds=STEP_SECONDS, network=Network(bandwidth=1.25e6), wire_format=True)
    cluster.run_until_finished(max_time=600.0)
    assert cluster.all_finished() and len(cluster.finished_at) == NODES
    return cluster, [learner.evaluate() for learner in cluster.learners()]


GRADIENT_GOSSIP = GossipConfig(fanout=2, average_every=10, averaging="full",
                               max_staleness_samples=4096)


@pytest.fixture(scope="module")
def baselines():
    """(corpus, loss of one node with 8x the batch, the 8 nodes without communication)."""
    corpus = load_corpus(None, 0.1, 40)
    single = make_learner(corpus, "reference", NODES * BATCH)
    while not single.finished:
        single.train_step()
    alone, alone_losses = run_swarm(corpus, GossipConfig(fanout=0, average_every=0))
    assert all(len(n.machine.trainer.mixer.used) == 0 for n in alone.nodes)
    return corpus, single.evaluate(), alone, alone_losses


def check_swarm(baselines, gossip: GossipConfig, min_peers_used: int) -> None:
    corpus, reference, alone, alone_losses = baselines
    swarm, losses = run_swarm(corpus, gossip)
    distances = [d for _, d in swarm.distances]
    final = consensus_distance([lr.params for lr in swarm.learners()])
    final_alone = consensus_distance([lr.params for lr in alone.learners()])
    peers_used = [len(n.machine.trainer.mixer.used) for n in swarm.nodes]
    samples = sum(lr.samples for lr in swarm.learners())
    print(f"\n{gossip}\nheld-out loss: one node x{NODES} batch {reference:.4f}; swarm worst "
          f"{max(losses):.4f} best {min(losses):.4f} ({max(losses) / reference - 1:+.1%}); "
          f"no communication worst {max(alone_losses):.4f} best {min(alone_losses):.4f}\n"
          f"consensus distance: swarm final {final:.5f}, max {max(distances):.5f}; "
          f"no communication final {final_alone:.5f} ({final_alone / final:.0f}x)\n"
          f"peers whose gradients each node used: {peers_used}; swarm samples {samples}; "
          f"virtual time {swarm.now:.0f} s")

    assert reference < 2.0  # the reference did learn
    assert max(losses) <= 1.05 * reference
    assert min(peers_used) >= min_peers_used
    assert TOTAL <= samples <= 1.01 * TOTAL  # ended at the total (the count lags a little)
    # Bounded: the distance never leaves a band well below where no communication ends,
    # and shows no upward trend late in the run.
    half = len(distances) // 2
    assert max(distances) < 0.5 * final_alone
    assert max(distances[half:]) <= max(distances[:half])
    assert final_alone >= 10 * final


@pytest.mark.slow
def test_eight_nodes_with_gradient_gossip_train_like_one_node_with_eight_times_the_batch(
        baselines):
    check_swarm(baselines, GRADIENT_GOSSIP, min_peers_used=2)


@pytest.mark.slow
def test_eight_nodes_with_the_default_algorithm_train_like_one_node_with_eight_times_the_batch(
        baselines):
    assert GossipConfig().fanout == 0  # the defaults average only: no gradient travels
    check_swarm(baselines, GossipConfig(), min_peers_used=0)



OUTER = GossipConfig(outer_every=20, fanout=2, fraction=0.1, average_every=20,
                     outer_momentum=1.0, outer_rewind=False)


@pytest.mark.slow
def test_eight_nodes_sharing_compressed_pseudo_gradients_train_like_one_node(baselines):
    """Issue 17's outer steps: every 20 steps each node sends the top 10% of the progress it
    owes to 2 peers and moves by the average; 10% int8 averaging every 20 steps holds the
    replicas together. Within 5% of one node with 8x the batch, like the default, with every
    node using its peers' pseudo-gradients, at 50x fewer bytes than one dense fp32 gradient
    per step. (This small run does not tell communication schemes apart well -- 8 nodes
    without any communication end 4.6% above the reference -- it catches outer steps that
    hurt: a first version ended 9-15% above.)"""
    corpus, reference, alone, alone_losses = baselines
    swarm, losses = run_swarm(corpus, OUTER)
    steps = [n.machine.trainer.learner.step for n in swarm.nodes]
    sent = sum(sum(n.machine.bytes_out.values()) for n in swarm.nodes)
    dense = 4 * MODEL.space.n_params * sum(steps)
    peers_used = [len(n.machine.trainer.mixer.used) for n in swarm.nodes]
    outer_steps = [n.machine.trainer.stats["outer_steps"] for n in swarm.nodes]
    print(f"\nouter steps: held-out worst {max(losses):.4f} ({max(losses) / reference - 1:+.1%});"
          f" sent {sent / 1e6:.1f} MB, {dense / sent:.0f}x less than dense fp32 gradients; "
          f"peers used {peers_used}; outer steps {outer_steps}")
    assert max(losses) <= 1.05 * reference
    assert min(peers_used) >= 2 and min(outer_steps) >= 30
    assert dense >= 50 * sent
