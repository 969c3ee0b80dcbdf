"""p2ptrain.proto is sans-IO: it imports no I/O stack, reads no clock, uses no global
randomness and builds no unseeded generator. Sub-packages are walked too, and the number of
modules checked is pinned, so moving a file cannot silently shrink the check."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import p2ptrain.proto

PROTO = Path(p2ptrain.proto.__file__).parent
FILES = sorted(PROTO.rglob("*.py"))
MODULES = sorted(
    "p2ptrain.proto" + "".join("." + part for part in p.relative_to(PROTO).with_suffix("").parts
                               if part != "__init__")
    for p in FILES)
EXPECTED_MODULES = 40  # update when a module is added to or removed from p2ptrain/proto


def test_the_check_covers_every_proto_module():
    assert len(MODULES) == EXPECTED_MODULES, MODULES
    for name in ("node", "gossip.trainer", "gossip.messages", "membership.swim", "election"):
        assert f"p2ptrain.proto.{name}" in MODULES


@pytest.mark.processes
def test_proto_imports_no_io_stack():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "bad = [m for m in ('asyncio', 'aiohttp', 'zeroconf', 'socket', 'selectors')"
            + " if m in sys.modules]\n"
            + "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


FORBIDDEN_IMPORTS = {"time", "datetime", "asyncio", "socket", "aiohttp", "zeroconf",
                     "threading", "selectors"}
SEEDED = {"Generator", "default_rng", "SeedSequence", "PCG64", "Philox", "BitGenerator"}
SEED_TAKING = {"default_rng", "SeedSequence", "PCG64", "Philox", "Random"}
GLOBAL_RANDOM = {"random", "choice", "choices", "randint", "randrange", "shuffle", "sample",
                 "uniform", "seed", "getrandbits", "gauss"}


def impurities(source: str) -> list[str]:
    """What makes a module impure: forbidden imports, global random functions, unseeded
    generators. Returns one line per finding."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = {a.name.split(".")[0] for a in node.names}
            found += [f"imports {n}" for n in sorted(names & FORBIDDEN_IMPORTS)]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_IMPORTS:
                found.append(f"imports from {node.module}")
            if node.module == "random" and {a.name for a in node.names} - {"Random"}:
                found.append("imports a global random function")
            if node.module == "numpy.random" and {a.name for a in node.names} - SEEDED:
                found.append("imports a global numpy random function")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "random" and node.attr in GLOBAL_RANDOM):
            found.append(f"calls random.{node.attr}")
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name)
                and node.value.value.id in ("np", "numpy") and node.value.attr == "random"
                and node.attr not in SEEDED):
            found.append(f"uses np.random.{node.attr}")
        if isinstance(node, ast.Call) and not node.args and not node.keywords:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in SEED_TAKING:
                found.append(f"builds an unseeded {name}()")
    return found


def test_proto_reads_no_clock_and_no_global_random_state():
    bad = {str(p.relative_to(PROTO)): impurities(p.read_text()) for p in FILES}
    assert not {k: v for k, v in bad.items() if v}


def test_the_purity_check_catches_what_it_should():
    assert impurities("import time\n")
    assert impurities("from datetime import datetime\n")
    assert impurities("import random\nx = random.random()\n")
    assert impurities("from random import shuffle\n")
    assert impurities("import random\nr = random.Random()\n")
    assert impurities("import numpy as np\ng = np.random.default_rng()\n")
    assert impurities("import numpy as np\nx = np.random.rand(3)\n")
    assert not impurities("import random\nr = random.Random(7)\n")
    assert not impurities("import numpy as np\ng = np.random.default_rng(rng.getrandbits(64))\n")


def test_every_proto_file_says_what_it_owns():
    for path in FILES:
        text = path.read_text()
        assert text.startswith('"""'), path
        assert len(text.splitlines()) <= 450, path
