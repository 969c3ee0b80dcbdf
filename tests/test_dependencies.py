"""The package's runtime dependencies are exactly the third-party modules `p2ptrain/` imports
(optional ones, behind extras, are imported only inside functions and listed in extras)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from tests.helpers import REPO

IMPORT_NAME = {"pyyaml": "yaml", "prometheus-client": "prometheus_client"}  # dist -> module


def _dist_to_module(spec: str) -> str:
    name = re.split(r"[<>=!~\[ ;]", spec, maxsplit=1)[0].strip().lower()
    return IMPORT_NAME.get(name, name.replace("-", "_"))


def third_party_imports(top_level_only: bool) -> set[str]:
    found = set()
    for path in (REPO / "p2ptrain").rglob("*.py"):
        tree = ast.parse(path.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        for node in nodes:
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "p2ptrain"}


def test_runtime_dependencies_are_exactly_what_the_package_imports():
    project = tomllib.loads(Path(REPO / "pyproject.toml").read_text())["project"]
    declared = {_dist_to_module(d) for d in project["dependencies"]}
    assert third_party_imports(top_level_only=True) == declared
    extras = {_dist_to_module(d) for deps in project["optional-dependencies"].values()
              for d in deps}
    assert third_party_imports(top_level_only=False) <= declared | extras


def test_the_package_has_an_mit_license():
    text = (REPO / "LICENSE").read_text()
    assert text.startswith("MIT License") and "WITHOUT WARRANTY" in text
