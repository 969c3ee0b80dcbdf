"""Shared helpers: running the real `p2ptrain` command as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: no P2PTRAIN_* from the caller, small BLAS pool."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_cli(*args: str, env: dict | None = None, timeout: float = 300, cwd=None):
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True,
                          text=True, env=env or cli_env(), timeout=timeout, cwd=cwd or REPO)


@pytest.fixture
def small_mlp_config(tmp_path: Path) -> Path:
    """A TOML config for a tiny, fast mlp run."""
    path = tmp_path / "small.toml"
    path.write_text(
        '[model]\nname = "mlp"\n[model.mlp]\nn_hidden = 32\nn_embd = 8\nctx_len = 16\n'
        "[train]\nbatch = 8\nwarmup_samples = 16\n[eval]\nwindows = 8\nevery_seconds = 0\n"
    )
    return path
