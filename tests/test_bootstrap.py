"""bootstrap/setup.sh: the clear refusals (the full install is what CI itself runs)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

pytestmark = [pytest.mark.processes]

SETUP = REPO / "bootstrap" / "setup.sh"


def fake_path(tmp_path: Path, python_version: str | None, machine: str = "x86_64") -> str:
    """A PATH holding only the tools setup.sh uses, a stub `uname`, and maybe a stub python3."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sed", "id", "dirname", "cat", "rm"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    (bin_dir / "uname").write_text(f"#!/bin/sh\necho {machine}\n")
    if python_version:
        major, minor = python_version.split(".")
        (bin_dir / "python3").write_text(
            "#!/bin/sh\n"
            f'case "$*" in *version_info*) [ {minor} -ge 11 ]; exit $?;; esac\n'
            f"echo Python {python_version}\n")
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    return str(bin_dir)


def run_setup(path: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["/bin/bash", str(SETUP), *args], capture_output=True, text=True,
                          env={"PATH": path, "HOME": "/tmp"}, timeout=60)


def test_old_python_gets_a_plain_explanation(tmp_path):
    r = run_setup(fake_path(tmp_path, "3.9"))
    assert r.returncode == 1
    assert "needs Python 3.11 or newer" in r.stderr and "Python 3.9" in r.stderr


def test_32_bit_systems_are_told_to_use_a_64_bit_os(tmp_path):
    r = run_setup(fake_path(tmp_path, "3.11", machine="armv7l"))
    assert r.returncode == 1 and "64-bit" in r.stderr


def test_help_and_unknown_arguments(tmp_path):
    path = fake_path(tmp_path, "3.11")
    r = run_setup(path, "--help")
    assert r.returncode == 0 and "--test" in r.stdout
    r = run_setup(path, "--bogus")
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
