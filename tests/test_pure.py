"""The pure core never imports the I/O stack: asyncio, aiohttp or zeroconf."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.processes]

PURE = ["p2ptrain.params", "p2ptrain.models", "p2ptrain.optim", "p2ptrain.data",
        "p2ptrain.learner", "p2ptrain.swarmcount", "p2ptrain.sample", "p2ptrain.codecs"]


def test_pure_modules_import_no_io_stack():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in PURE)
            + "bad = [m for m in ('asyncio', 'aiohttp', 'zeroconf') if m in sys.modules]\n"
            + "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
