"""Shared helpers: running the real `p2ptrain` command as a subprocess.

Tests run BLAS single-threaded: the small models here gain nothing from a second thread, and
on a shared 2-core machine a 2-thread BLAS call waits for its descheduled twin (5-10x slower).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before anything imports numpy

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: no P2PTRAIN_* from the caller, small BLAS pool,
    a node that trains alone (no network: tests never join the demo swarm)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env["P2PTRAIN_ALONE"] = "true"  # tests of the networked node say so (swarm_env)
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
