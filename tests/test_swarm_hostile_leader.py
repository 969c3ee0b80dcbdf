"""A hostile leader (issue 13, item 13): a key holder wins the election (priority is
self-advertised) and signs a wrecked checkpoint with its own identity. A joiner fetches it,
verifies the signature -- it is genuine -- and still refuses it: its weights are not usable
(held-out loss far above the joiner's own replica on a fixed batch, or no better than the
fresh replica it starts from). Real processes."""

from __future__ import annotations

import numpy as np
import pytest

from p2ptrain import checkpoint
from p2ptrain.config import resolve, settings_of
from p2ptrain.data import load_corpus
from p2ptrain.identity import load_or_create
from p2ptrain.learner import Learner
from p2ptrain.models import build_model
from tests.swarmlab import SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def _wrecked_checkpoint(lab: SwarmLab, state_dir, term: int, wreck: str) -> None:
    """Sign a checkpoint of wrecked weights with the leader's own identity, newer than
    anything the swarm has, into the leader's checkpoint directory (it serves its newest):
    "scaled", initial weights times 10^4 (confidently wrong: a held-out loss of ~10^11 nats),
    "uniform", all 65,504 (they predict uniformly on numpy 2.4: a fresh replica's loss), or
    "nan", every seventh weight not a number."""
    cfg = resolve(str(lab.config), {}, {})
    settings = settings_of(cfg)
    model = build_model(settings.model_name, settings.model)
    identity = load_or_create(state_dir, bump_incarnation=False)
    learner = Learner(model, identity.node_id, settings.train,
                      load_corpus(None, 0.1, model.ctx_len + 2), 8, 1, 8)
    if wreck == "scaled":
        learner.params *= np.float32(1e4)
    elif wreck == "nan":
        learner.params[::7] = np.nan
    else:
        learner.params.fill(65504.0)
    learner.step = 10**6
    learner.count.add(identity.node_id, 10**8)
    checkpoint.save(state_dir / "checkpoints", learner.snapshot(term), identity, keep=5)


@pytest.mark.parametrize("wreck", ["scaled", "uniform", "nan"])
def test_a_joiner_refuses_a_wrecked_checkpoint_signed_by_the_leader(tmp_path, wreck):
    with SwarmLab(tmp_path) as lab:
        ports = free_ports(2)
        hostile = lab.start("hostile", ports[0], [], "--priority", "100")
        wait_for("the hostile node to lead", lambda: hostile.status()["is_leader"], 60)
        wait_for("a checkpoint of its own", lambda: checkpoint.list_checkpoints(
            hostile.state_dir / "checkpoints"), 60)
        _wrecked_checkpoint(lab, hostile.state_dir, hostile.status()["term"], wreck)
        joiner = lab.start("joiner", ports[1], [hostile.addr])
        starts = wait_for("the joiner to start training", lambda: [
            e for e in joiner.events() if e.get("event") == "training_starts"], 90)
        reason = starts[0]["reason"]
        if wreck == "scaled":  # far worse than fresh weights: refused, the leader named
            assert reason.startswith("refused the leader's checkpoint"), reason
        elif wreck == "nan":  # refused, and neither kept nor served to other joiners
            assert reason.startswith("refused the leader's checkpoint"), reason
            assert "not finite" in reason, reason
            assert checkpoint.list_checkpoints(joiner.state_dir / "fetched") == []
        else:  # as good as fresh weights by the loss: not taken (or, where it overflows, refused)
            assert reason.startswith(("the leader's checkpoint is no better than fresh weights",
                                      "refused the leader's checkpoint")), reason
        wait_for("the joiner to step", lambda: joiner.status()["step"] > 3, 60)
        doc = joiner.status()
        assert doc["loss"] is not None and np.isfinite(doc["loss"]) and doc["loss"] < 10
