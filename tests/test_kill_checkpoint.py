"""kill -9 in the middle of a checkpoint write never leaves a checkpoint that loads."""

import json
import signal

import pytest

from p2ptrain import checkpoint
from tests.helpers import cli_env, run_cli

pytestmark = [pytest.mark.processes]


def test_kill_mid_write_resumes_from_the_previous_good_checkpoint(tmp_path, small_mlp_config):
    state = tmp_path / "state"
    args = ["join", "--config", str(small_mlp_config), "--state-dir", str(state),
            "--log-format", "json"]
    env = cli_env(P2PTRAIN_CHECKPOINT_EVERY_STEPS="5", P2PTRAIN_FAULT="kill-mid-checkpoint:3")
    killed = run_cli(*args, "--steps", "100", env=env)
    assert killed.returncode == -signal.SIGKILL
    root = state / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(root)] == [
        "ckpt-t000000-s0000000010", "ckpt-t000000-s0000000005"]
    partial = checkpoint.stale_temporaries(root)
    assert len(partial) == 1 and "s0000000015" in partial[0].name
    model_file = partial[0] / checkpoint.MODEL_FILE
    assert model_file.exists() and model_file.stat().st_size > 0
    assert not (partial[0] / "manifest.json").exists()

    again = run_cli(*args, "--steps", "1", env=cli_env())
    assert again.returncode == 0, again.stderr
    assert "removing partial checkpoint" in again.stderr
    resumed = [json.loads(line) for line in again.stdout.splitlines()]
    assert any(e["event"] == "resumed" and e["step"] == 10 for e in resumed)
    assert checkpoint.stale_temporaries(root) == []
