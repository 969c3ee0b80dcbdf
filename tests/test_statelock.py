"""The state directory's lock (p2ptrain/statelock.py): what a user sees when the path given
as --state-dir cannot be one."""

from __future__ import annotations

import pytest

from p2ptrain.errors import UserError
from p2ptrain.statelock import lock_state_dir


def test_a_file_given_as_the_state_directory_is_named_as_such(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="afile: it is a file, not a directory$"):
        lock_state_dir(tmp_path / "afile")  # was mkdir's "File exists"
    with pytest.raises(UserError, match="sub: Not a directory$"):
        lock_state_dir(tmp_path / "afile" / "sub")


def test_a_checkpoints_file_in_the_state_directory_is_refused_at_start(tmp_path):
    """It was found at the first write: a whole run trained, then 'the final checkpoint was
    not written ... the steps since the start are lost'."""
    from tests.helpers import cli_env, run_cli

    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "checkpoints").write_text("x")
    r = run_cli("join", "--alone", "--state-dir", str(tmp_path / "st"), "--steps", "3",
                env=cli_env())  # (startup.prepare: the networked node's start too)
    assert r.returncode == 2 and "checkpoints is a file, not the node's checkpoint " \
        "directory" in r.stderr, r.stderr[-800:]
