"""`p2ptrain key rotate`: shut a member out of a swarm by replacing the swarm key.

On the operator's copy of the swarm's files (as `init` wrote them), it keeps the current key
as the previous key (`swarm.key` -> `swarm.previous.key`), puts a new key in the key file
(both mode 0600), names the previous key and its grace in the configuration's `[swarm]`
section (`previous_key_file`, `previous_key_grace`; the rest of the file, comments included,
is kept as it was), and prints the new join token and what to do next. Nodes that run go on
with the keys they read at their start; each member restarted with the new files signs with
the new key and accepts the old one for the grace (p2ptrain.net.keyring). Files are written
in an order that leaves a usable swarm at every step: the previous key, then the
configuration, then the new key.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import tomllib
from pathlib import Path

from p2ptrain.errors import UserError
from p2ptrain.fsutil import describe_os_error

_HEADER = re.compile(r"^\s*\[([^\[\]]*)\]\s*(#.*)?$")
MAX_GRACE = 365 * 86400.0  # s: a grace longer than a year is a typo
_KEY_LINE = re.compile(r"^\s*(previous_key_file|previous_key_grace)\s*=")


def add_key_parser(sub) -> None:
    """The `key` subcommand and its `rotate` action."""
    key = sub.add_parser("key", help="swarm key tools (rotate: shut a member out)")
    key_sub = key.add_subparsers(dest="key_command", metavar="ACTION", required=True)
    rotate = key_sub.add_parser(
        "rotate", help="replace the swarm key; the old one stays accepted for a grace period",
        description="Keep the swarm key as the previous key (swarm.previous.key), write a new "
        "key (mode 0600), name both in the configuration's [swarm] section, and print the new "
        "join token. Give the new files to the members you still trust and restart them one "
        "at a time: each accepts the previous key for the grace period (seconds of its own "
        "running time), then refuses it, so a member holding only the old key is shut out.")
    rotate.add_argument("--config", help="the swarm's configuration file, as `p2ptrain init` "
                        "wrote it (swarm-NAME/swarm.toml) [env P2PTRAIN_CONFIG]")
    rotate.add_argument("--grace", type=float, default=None, metavar="SECONDS",
                        help="seconds of each node's running time the previous key stays "
                        "accepted (default: the file's previous_key_grace, else 3600)")


def set_swarm_lines(text: str, lines: list[str]) -> str:
    """`text` (TOML) with `lines` in its [swarm] section after `key_file`, replacing any
    previous_key_file / previous_key_grace there; UserError if there is no [swarm] table."""
    out, in_swarm, placed, found = [], False, False, False
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            in_swarm = header.group(1).strip() == "swarm"
            found = found or in_swarm
        elif in_swarm and _KEY_LINE.match(line):
            continue  # replaced below
        out.append(line)
        if in_swarm and not placed and re.match(r"^\s*key_file\s*=", line):
            out += lines
            placed = True
    if not found:
        raise UserError("the configuration has no [swarm] table to name the previous key in")
    if not placed:  # no key_file line in [swarm]: right after its header
        at = next(i for i, line in enumerate(out)
                  if (h := _HEADER.match(line)) and h.group(1).strip() == "swarm")
        out[at + 1:at + 1] = lines
    return "\n".join(out) + "\n"


def cmd_key_rotate(args) -> int:
    from p2ptrain.cli.swarmcmds import key_path_of
    from p2ptrain.config import config_file_from, read_file, resolve
    from p2ptrain.fsutil import atomic_write_bytes
    from p2ptrain.swarm import keep_previous, previous_path, replace_key

    config_file = config_file_from(getattr(args, "config", None))
    if not config_file:
        raise UserError("key rotate works on the swarm's files: give --config "
                        "swarm-NAME/swarm.toml (as `p2ptrain init` wrote it)")
    config_path = Path(config_file).expanduser()
    cfg = resolve(config_file, {}, {})  # the file alone: it is what members will read
    if "swarm.key_file" not in read_file(config_path):
        raise UserError(f"{config_path} names no [swarm] key_file: only a swarm whose key is "
                        f"in a file (as `p2ptrain init` writes it) can be rotated")
    name = cfg["swarm.name"] or "swarm"
    key_path = key_path_of(cfg, "swarm.key_file", config_file)
    grace = cfg["swarm.previous_key_grace"] if args.grace is None else args.grace
    if not (math.isfinite(grace) and 0 <= grace <= MAX_GRACE):  # before saying anything
        raise UserError(f"--grace {grace:g}: seconds, a finite number in 0..{MAX_GRACE:g} "
                        f"(a year)")
    dropped = cfg["swarm.previous_key_file"]
    prev_text = dropped or previous_path(Path(cfg["swarm.key_file"])).as_posix()
    prev_path = Path(prev_text).expanduser()
    if not prev_path.is_absolute():
        prev_path = config_path.parent / prev_path
    text = config_path.read_text()
    new_text = set_swarm_lines(text, [
        f"previous_key_file = {json.dumps(prev_text)}  # secret: the key before the last "
        f"`p2ptrain key rotate`",
        f"previous_key_grace = {float(grace)!r}  # s of each node's running time it is "
        f"still accepted"])
    written = tomllib.loads(new_text).get("swarm", {})
    if (written.get("previous_key_file"), written.get("previous_key_grace")) != (
            prev_text, float(grace)):
        raise UserError(f"could not name the previous key in {config_path}; nothing changed")

    try:  # the previous key's place takes the current key (the one before is dropped then)
        old = keep_previous(key_path, prev_path, name)
    except OSError as exc:
        raise UserError(f"key rotate: {describe_os_error(exc)}; the key is not rotated") from None
    if dropped:
        print(f"note: the key before this one ({dropped}) is dropped now: members that "
              f"still hold only it are refused at once")
    try:  # then the config naming it, then the new key: a failure leaves the key as it was
        atomic_write_bytes(config_path, new_text.encode(),
                           mode=stat.S_IMODE(os.stat(config_path).st_mode))
        new = replace_key(key_path, old)
    except OSError as exc:
        raise UserError(f"key rotate: {describe_os_error(exc)}; the key is not rotated (its "
                        f"copy is in {prev_path})") from None
    print(f"swarm {name!r}: key rotated, swarm id {old.swarm_id} -> {new.swarm_id}")
    print(f"  {key_path}   the new key (secret, mode 0600)")
    print(f"  {prev_path}   the previous key (secret, mode 0600)")
    print(f"  {config_path}   names both; previous key accepted for {grace:g}s")
    print("\nnew join token (secret):\n")
    print(f"  {new.token()}\n")
    print("next, without stopping the fleet:")
    print(f"  1. copy {config_path.name}, {key_path.name} and {prev_path.name} to every member "
          f"you still trust (never to the one you shut out)")
    print("  2. restart those members one at a time with the new files:")
    print(f"       p2ptrain join --config {config_path}")
    print("     (a member that joins by token: --token NEW_TOKEN, with "
          "P2PTRAIN_SWARM_PREVIOUS_KEY_FILE pointing at a file holding the old token or key)")
    print(f"  3. restart them all within {grace:g}s of the first restart: each restarted "
          f"member accepts the previous key for {grace:g}s of its own running time (counted "
          f"on its monotonic clock and kept in its state directory, as Pis have no real-time "
          f"clock), then refuses it (HTTP 401, 'the swarm key was rotated')")
    print("  4. a member that holds only the old key is then refused by everyone and exits 2 "
          "(after net.refused_seconds); once it is out, you may delete the previous key file "
          "and the previous_key_* lines")
    return 0
