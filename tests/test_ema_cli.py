"""`train.ema` end to end: `join --alone` with it says so at the start and writes checkpoints
whose weights are the average of the weights it trained -- exactly the average of the
weights three plain runs of 1, 2 and 3 steps of the same node (same identity, same data)
wrote."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from p2ptrain import checkpoint
from p2ptrain.checkpoint.safetensors_io import read_header, read_into
from p2ptrain.learner import ema_decay
from tests.helpers import cli_env, run_cli

pytestmark = [pytest.mark.processes]


def weights_after(tmp_path, name: str, steps: int, identity, ema: float = 0.0) -> np.ndarray:
    state = tmp_path / name
    state.mkdir()
    shutil.copy(identity, state / identity.name)  # the same node: the same data order
    env = cli_env(P2PTRAIN_STATE_DIR=str(state), P2PTRAIN_TRAIN_EMA=str(ema),
                  P2PTRAIN_LOG_FORMAT="text", P2PTRAIN_CHECKPOINT_EVERY_SECONDS="3600")
    done = run_cli("join", "--steps", str(steps), "--batch", "8", env=env, timeout=180)
    assert done.returncode == 0, done.stderr
    out = done.stdout + done.stderr
    assert ("checkpoints carry an average of the weights" in out) == (ema > 0)
    assert ("the average in checkpoints" in out) == (ema > 0)  # the final evaluation
    [path] = checkpoint.list_checkpoints(state / "checkpoints")
    assert checkpoint.read_manifest(path).step == steps
    with open(path / checkpoint.MODEL_FILE, "rb") as f:
        header, start = read_header(f)
        tensors = {name: np.zeros(entry["shape"], np.float32)
                   for name, entry in header.items() if name != "__metadata__"}
        read_into(f, header, start, tensors)
    return np.concatenate([tensors[name].ravel() for name in sorted(tensors)])


def test_join_alone_with_ema_checkpoints_the_average_of_its_weights(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    made = run_cli("join", "--steps", "1", "--batch", "8",
                   env=cli_env(P2PTRAIN_STATE_DIR=str(first)), timeout=180)
    assert made.returncode == 0, made.stderr
    identity = first / "identity.key"
    w = [weights_after(tmp_path, f"plain{k}", k, identity) for k in (1, 2, 3)]
    averaged = weights_after(tmp_path, "ema", 3, identity, ema=0.99)
    d1, d2 = ema_decay(0.99, 1), ema_decay(0.99, 2)
    expected = d2 * (d1 * w[0] + (1 - d1) * w[1]) + (1 - d2) * w[2]
    np.testing.assert_allclose(averaged, expected, rtol=1e-5, atol=1e-7)
    assert not np.allclose(averaged, w[2], rtol=1e-3, atol=1e-5)
