"""From parsed command-line arguments to a resolved configuration: the option flags a command
was given, and the configuration they resolve to (flag > environment > file > default). Shared
by the parser's module and the commands, so neither imports the other.
"""

from __future__ import annotations

import argparse
import os


def flags_of(args: argparse.Namespace) -> dict:
    """Option key -> raw value of every option flag that was given."""
    return {k[4:]: ",".join(v) if isinstance(v, list) else v
            for k, v in vars(args).items() if k.startswith("opt:") and v is not None}


def resolve_config(args: argparse.Namespace):
    from p2ptrain.config import config_file_from, resolve

    return resolve(config_file_from(getattr(args, "config", None)), os.environ, flags_of(args))
