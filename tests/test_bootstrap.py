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


def test_a_venv_an_older_python_left_is_made_anew(tmp_path):
    """A .venv of Python 3.10 (Ubuntu 22.04's) was reused, and pip then refused p2ptrain in
    it ("requires a different Python"). Here the new one cannot be made (the stub python3
    refuses `-m venv`): setup says which venv it found too old, and stops."""
    path = fake_path(tmp_path, "3.11")
    old = tmp_path / "venv" / "bin"
    old.mkdir(parents=True)
    (old / "python").write_text("#!/bin/sh\n"
                                'case "$*" in *version_info*) exit 1;; esac\n'
                                "echo Python 3.10.13\n")
    (old / "python").chmod(0o755)
    stub = Path(path) / "python3"
    stub.write_text(stub.read_text().replace("#!/bin/sh\n", '#!/bin/sh\ncase "$*" in '
                                             "*venv*) exit 1;; esac\n", 1))
    r = run_setup(path, "--venv", str(tmp_path / "venv"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Python 3.10.13, older than 3.11" in r.stdout, r.stdout
    assert "cannot recreate" in r.stderr


def test_an_install_that_does_not_start_is_no_success(tmp_path):
    """`p2ptrain --version` failing (a broken install) still ended in "setup: done" and exit
    0: set -e does not see a failure inside the message's $(...)."""
    path = fake_path(tmp_path, "3.11")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("#!/bin/sh\nexit 0\n")  # 3.11+, and pip installs "fine"
    (venv / "p2ptrain").write_text("#!/bin/sh\necho \"ModuleNotFoundError: numpy\" >&2\n"
                                   "exit 1\n")
    for f in venv.iterdir():
        f.chmod(0o755)
    r = run_setup(path, "--venv", str(tmp_path / "venv"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "done" not in r.stdout and "does not start" in r.stderr
