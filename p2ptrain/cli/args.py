"""From parsed command-line arguments to what commands work on: the option flags a command
was given, the configuration they resolve to (flag > environment > file > default), and the
checkpoint a `--checkpoint PATH` names. Shared by the parser's module and the commands, so none
of them imports another.
"""

from __future__ import annotations

import argparse
import os
import sys
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
            except checkpoint.CheckpointError as exc:  # the next older one, said so
                print(f"p2ptrain: warning: skipped {candidate.name}: {exc}", file=sys.stderr)
                continue
    if not path.exists():
        raise UserError(f"checkpoint path {path} does not exist")
    raise UserError(f"no valid checkpoint found at {path}")


def model_params(path: Path, manifest: Manifest, model):
    """`model`'s parameter vector, filled from the checkpoint at `path` -- allocated only once
    the checkpoint's model file is big enough to hold it (its arch is what the file says: a
    made-up one must not make this allocate petabytes)."""
    from p2ptrain import checkpoint
    from p2ptrain.errors import UserError

    size = manifest.files[checkpoint.MODEL_FILE].size
    if model.space.n_params * 2 > size:
        raise UserError(f"{path.name}: its arch describes {model.space.n_params:,} parameters, "
                        f"more than its {size:,}-byte model file can hold")
    params = model.space.zeros()
    meta = checkpoint.load_tensors(path, checkpoint.MODEL_FILE, model.space.views(params))
    return params, meta
