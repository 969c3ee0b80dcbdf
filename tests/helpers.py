"""Helpers the tests import: the repository root and running the real `p2ptrain` command as
a subprocess (never joining the demo swarm: it trains alone unless a test says otherwise)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def introduce(signer, server):
    """A hello from `signer` (auth.Signer) to `server` (auth.ServerAuth) in memory, as the
    route makes it: both keep their pair key; the server's Receiver is returned."""
    import secrets

    nonce = secrets.token_hex(16)
    body, headers = server.welcome(signer.hello_headers(nonce))
    return signer.check_welcome(nonce, headers, body)
