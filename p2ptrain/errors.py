"""`UserError`: a problem the user can fix (a bad path, a wrong checkpoint, a busy port). The
CLI prints it as one line and exits 2; it never carries a traceback. This file owns the class
and nothing else."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix; printed as one line."""
