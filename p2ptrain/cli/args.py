"""From parsed command-line arguments to what commands work on: the option flags a command
was given, the configuration they resolve to (flag > environment > file > default), and the
checkpoint a `--checkpoint PATH` names. Shared by the parser's module and the commands, so none
of them imports another.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2ptrain.checkpoint import Manifest


def flags_of(args: argparse.Namespace) -> dict:
    """Option key -> raw value of every option flag that was given."""
    return {k[4:]: ",".join(v) if isinstance(v, list) else v
            for k, v in vars(args).items() if k.startswith("opt:") and v is not None}


def resolve_config(args: argparse.Namespace):
    from p2ptrain.config import config_file_from, resolve

    return resolve(config_file_from(getattr(args, "config", None)), os.environ, flags_of(args))


def resolve_checkpoint(path: Path) -> tuple[Path, Manifest]:
    """A checkpoint directory, or the newest valid one under a state or checkpoints dir."""
    from p2ptrain import checkpoint
    from p2ptrain.errors import UserError

    if (path / checkpoint.store.MANIFEST_FILE).exists():
        return path, checkpoint.read_manifest(path)
    for root in (path / "checkpoints", path):
        for candidate in checkpoint.list_checkpoints(root):
            try:
                return candidate, checkpoint.read_manifest(candidate)
            except checkpoint.CheckpointError:
                continue
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist")
    raise UserError(f"no valid checkpoint found at {path}")
