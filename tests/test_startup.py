"""What a node does before its first step (p2ptrain/startup.py): it resumes from its newest
valid checkpoint and remembers that checkpoint's term, so a restarted node never writes a
checkpoint in a lower term than one it wrote before (the chaos soak's monotonicity)."""

from __future__ import annotations

import io

from p2ptrain import checkpoint
from p2ptrain.config import resolve, settings_of
from p2ptrain.report import Reporter
from p2ptrain.startup import prepare


def test_a_resumed_node_knows_the_term_of_its_checkpoint(tmp_path):
    cfg = resolve(None, {}, {"model.name": "mlp", "model.mlp.n_hidden": 16,
                             "model.mlp.n_embd": 8, "model.mlp.ctx_len": 16,
                             "train.batch": 8, "node.state_dir": str(tmp_path)})
    quiet = Reporter("json", out=io.StringIO(), err=io.StringIO())
    first = prepare(settings_of(cfg), quiet)
    assert first.term == 0
    first.learner.train_step()
    checkpoint.save(first.ckroot, first.learner.snapshot(term=7), first.identity, keep=3)
    again = prepare(settings_of(cfg), quiet)
    assert again.term == 7 and again.learner.step == 1
