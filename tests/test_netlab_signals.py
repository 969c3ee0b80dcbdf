"""A pytest run ended by SIGTERM (a CI timeout, `kill`) or SIGHUP (a closed terminal) still
removes its network namespaces, bridge, veths and the processes it started in them.

Each test runs an inner pytest (with tests/conftest.py as its plugin) on a tiny test that
builds a one-host NetLab, signals the inner run at a chosen moment, and checks that nothing of
the lab outlives it. Whatever happens, the test kills the inner run's process group and
removes the lab's names itself at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.netlab import _base36, require_netns
from tests.swarmlab import wait_for

pytestmark = [pytest.mark.netns, pytest.mark.processes]

PREFIX = "sigt"  # the inner labs' name prefix: no other test uses it
DEADLINE = 30.0  # seconds; each step normally takes well under one

# The inner tests. `ready` holds "<lab tag> <pid of the child in the namespace>".
INNER = """\
import os, sys, threading, time
from pathlib import Path
from tests.netlab import NetLab

TMP = Path({tmp!r})
# the child of test_closing: on SIGTERM it says so, then holds the lab's removal until `go`
HOLD = '''
import signal, sys, time
from pathlib import Path
tmp = Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (tmp / "got").touch())
(tmp / "up").touch()
while not (tmp / "go").exists():
    time.sleep(0.02)
'''


def ready(lab, child):
    (TMP / "ready.part").write_text(f"{{lab.tag}} {{child.pid}}")
    os.replace(TMP / "ready.part", TMP / "ready")


def test_blocked():  # the signal comes while the body runs
    with NetLab(1, prefix={prefix!r}) as lab:
        ready(lab, lab.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"]))
        time.sleep(600)


def test_closing():  # the signal comes while the lab is being removed
    with NetLab(1, prefix={prefix!r}) as lab:
        child = lab.popen(0, [sys.executable, "-c", HOLD, str(TMP)])
        while not (TMP / "up").exists() and child.poll() is None:
            time.sleep(0.02)
        ready(lab, child)


def test_closing_beside_a_thread():  # the kernel may hand the signal to the other thread
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    test_closing()
"""


def lab_names(tag: str) -> tuple[str, list[str]]:
    """The namespace and links a one-host NetLab with this tag makes."""
    return f"{tag}-h0", [f"br-{tag}", f"{tag}v0"]


def leftovers(tag: str) -> list[str]:
    """Which of the lab's namespace and links still exist."""
    ns, links = lab_names(tag)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    found = [ns] if ns in {line.split()[0] for line in listed.splitlines() if line} else []
    return found + [link for link in links if subprocess.run(
        ["ip", "link", "show", link], capture_output=True).returncode == 0]


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie waiting for its reaper counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@contextlib.contextmanager
def inner_run(tmp: Path, test: str) -> Iterator[tuple[subprocess.Popen, str, int]]:
    """Start the inner pytest on one inner test; yield it, its lab's tag and its child's pid
    once the lab is built. On the way out, kill its process group and remove the lab."""
    script = tmp / "test_inner.py"
    script.write_text(INNER.format(tmp=str(tmp), prefix=PREFIX))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p",
            "no:cacheprovider", "--rootdir", str(tmp), f"{script}::{test}"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    tag = f"{PREFIX}{_base36(proc.pid)}0"  # the inner's first lab, in case it never says

    def started() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"inner pytest exited {proc.returncode}:\n{proc.stdout.read()}")
        return (tmp / "ready").exists()

    try:
        wait_for("the inner test's lab", started, DEADLINE)
        tag, child = (tmp / "ready").read_text().split()
        yield proc, tag, int(child)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the inner pytest and its children
        proc.communicate(timeout=DEADLINE)
        ns, links = lab_names(tag)
        for args in (*(["link", "delete", link] for link in links), ["netns", "delete", ns]):
            subprocess.run(["ip", *args], capture_output=True)


def ended(proc: subprocess.Popen) -> str:
    """Wait for the signalled inner run to end; its output."""
    out, _ = proc.communicate(timeout=DEADLINE)
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signalled_run_removes_its_lab(tmp_path: Path, sig: signal.Signals) -> None:
    require_netns()
    with inner_run(tmp_path, "test_blocked") as (proc, tag, child):
        assert alive(child) and leftovers(tag) == [lab_names(tag)[0], *lab_names(tag)[1]]
        proc.send_signal(sig)  # the pytest process alone, not its group
        out = ended(proc)
        assert leftovers(tag) == [], out
        assert not alive(child), out
        assert proc.returncode == pytest.ExitCode.INTERRUPTED, out


@pytest.mark.parametrize("inner", ["test_closing", "test_closing_beside_a_thread"])
def test_a_signal_during_the_removal_lets_it_finish(tmp_path: Path, inner: str) -> None:
    require_netns()
    with inner_run(tmp_path, inner) as (proc, tag, child):
        wait_for("the lab's removal to begin (its child's SIGTERM)",
                 lambda: (tmp_path / "got").exists() or not alive(child), DEADLINE)
        assert alive(child), "the child ended before the removal could be held"
        proc.send_signal(signal.SIGTERM)
        (tmp_path / "go").touch()  # the child ends, the removal goes on
        out = ended(proc)
        assert leftovers(tag) == [], out
        assert not alive(child), out
        assert proc.returncode == pytest.ExitCode.INTERRUPTED, out
