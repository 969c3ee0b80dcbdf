"""Test setup and fixtures (helpers that tests import are in tests/helpers.py).

Tests run BLAS single-threaded: the small models here gain nothing from a second thread, and
on a shared 2-core machine a 2-thread BLAS call waits for its descheduled twin (5-10x slower).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before anything imports numpy

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def small_mlp_config(tmp_path: Path) -> Path:
    """A TOML config for a tiny, fast mlp run."""
    path = tmp_path / "small.toml"
    path.write_text(
        '[model]\nname = "mlp"\n[model.mlp]\nn_hidden = 32\nn_embd = 8\nctx_len = 16\n'
        "[train]\nbatch = 8\nwarmup_samples = 16\n[eval]\nwindows = 8\nevery_seconds = 0\n"
    )
    return path
