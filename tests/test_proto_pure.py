"""p2ptrain.proto is sans-IO: it imports no I/O stack, reads no clock, uses no global
randomness."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import p2ptrain.proto

PROTO = Path(p2ptrain.proto.__file__).parent
MODULES = sorted(f"p2ptrain.proto.{p.stem}" for p in PROTO.glob("*.py") if p.stem != "__init__")


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
GLOBAL_RANDOM = {"random", "choice", "choices", "randint", "randrange", "shuffle", "sample",
                 "uniform", "seed", "getrandbits", "gauss"}


def test_proto_reads_no_clock_and_no_global_random_state():
    for path in PROTO.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
                assert not names & FORBIDDEN_IMPORTS, (path.name, names)
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in FORBIDDEN_IMPORTS, path.name
                if node.module == "random":
                    assert {a.name for a in node.names} <= {"Random"}, path.name
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "random":  # the module: only random.Random may be used
                    assert node.attr not in GLOBAL_RANDOM, (path.name, node.attr)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and isinstance(node.value.value, ast.Name)
                  and node.value.value.id in ("np", "numpy") and node.value.attr == "random"):
                # np.random.Generator (a type) and seeded constructors only: no global state
                assert node.attr in SEEDED, (path.name, node.attr)


def test_every_proto_file_says_what_it_owns():
    for path in PROTO.glob("*.py"):
        text = path.read_text()
        assert text.startswith('"""'), path.name
        assert len(text.splitlines()) <= 450, path.name


def test_the_training_node_is_among_the_checked_modules():
    for name in ("node", "training", "gossipmsg", "trainharness", "harness"):
        assert f"p2ptrain.proto.{name}" in MODULES
