"""Test setup and fixtures (helpers that tests import are in tests/helpers.py).

Tests run BLAS single-threaded: the small models here gain nothing from a second thread, and
on a shared 2-core machine a 2-thread BLAS call waits for its descheduled twin (5-10x slower).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before anything imports numpy

import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_signalled: list[str] = []  # the termination signal received, if any


def _interrupt(signum: int, frame: object) -> None:
    """Turn SIGTERM or SIGHUP into KeyboardInterrupt, as if Ctrl-C: `finally` blocks, context
    managers, fixture teardown and atexit hooks then run, removing network namespaces, bridges
    and child processes (the default action ends the process on the spot). A repeat is ignored
    so that this cleanup finishes; SIGKILL still ends the run at once."""
    if _signalled:
        return
    _signalled.append(signal.Signals(signum).name)
    from tests import netlab  # (imported here: conftest loads before any test needs it)

    if netlab.defer_signal(_signalled[0]):  # a lab's removal runs: it raises when done
        return
    raise KeyboardInterrupt(f"{_signalled[0]} received: tearing down")


def pytest_configure(config: pytest.Config) -> None:
    """Install _interrupt for the whole run (also for atexit), unless something else handles
    or ignores the signal already (nohup)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _interrupt)


@pytest.fixture
def small_mlp_config(tmp_path: Path) -> Path:
    """A TOML config for a tiny, fast mlp run."""
    path = tmp_path / "small.toml"
    path.write_text(
        '[model]\nname = "mlp"\n[model.mlp]\nn_hidden = 32\nn_embd = 8\nctx_len = 16\n'
        "[train]\nbatch = 8\nwarmup_samples = 16\n[eval]\nwindows = 8\nevery_seconds = 0\n"
    )
    return path
