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
