"""A node's keyring from its swarm (keyring.py): the grace of the previous key is counted in
this node's own running time and saved in its state directory, so that a restart does not
open it again.

    <state-dir>/key-grace.json   {"previous": <swarm id of the previous key>, "used": <s>}

The time used is saved every `keyring.SAVE_EVERY` seconds during the grace and when it ends
(a crash loses at most that much of the count); a file naming another previous key (an
earlier rotation) counts for nothing. A timer on the event loop wakes the keyring during the
grace, so its end is logged when it happens (`key_retired`), not at the next request.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from pathlib import Path

from p2ptrain.fsutil import atomic_write_bytes, read_regular
from p2ptrain.net.auth import derive_mac_key
from p2ptrain.net.keyring import SAVE_EVERY, Keyring
from p2ptrain.report import Reporter
from p2ptrain.settings import SwarmConfig
from p2ptrain.swarm import Swarm

GRACE_FILE = "key-grace.json"
MAX_GRACE_BYTES = 4096  # what write_used writes is under 200 bytes


def read_used(path: Path, previous_id: str) -> float:
    """Seconds of grace of the previous key `previous_id` used by earlier lives: 0 if none
    (no file, or one of another rotation); all of it (inf) if the file is damaged -- a
    damaged count reopened the whole grace of a key rotated out to shut a member out."""
    if not path.exists():
        return 0.0
    try:
        doc = json.loads(read_regular(path, MAX_GRACE_BYTES))  # (a FIFO there hung the start)
        if doc["previous"] != previous_id:
            return 0.0
        used = doc["used"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):  # (nested 10^5 deep)
        return math.inf
    ok = isinstance(used, int | float) and not isinstance(used, bool) and used >= 0
    return float(used) if ok else math.inf


def write_used(path: Path, previous_id: str, used: float) -> None:
    """Save the grace used, atomically and durably."""
    atomic_write_bytes(path, json.dumps({"previous": previous_id,
                                         "used": round(used, 1)}).encode())


def keyring_of(swarm: Swarm, cfg: SwarmConfig, state_dir: Path, reporter: Reporter) -> Keyring:
    """The MAC keys of a node of `swarm`; with a previous key, its grace is counted, saved,
    logged, and its end logged. Call on the node's event loop."""
    current = derive_mac_key(swarm.key)
    if swarm.previous is None:
        return Keyring(current, ids=(swarm.swarm_id, ""))
    path, pid = state_dir / GRACE_FILE, swarm.previous_id

    def used(seconds: float) -> None:
        try:
            write_used(path, pid, seconds)
        except OSError as exc:
            reporter.warn(f"cannot save the key rotation's grace in {path}: "
                          f"{exc.strerror or exc}", event="key_grace_unsaved")

    def retired() -> None:
        reporter.info(f"the previous swarm key (id {pid}) is refused from now on: its grace of "
                      f"{cfg.previous_key_grace:g}s of this node's running time is over",
                      event="key_retired", previous_id=pid)

    keys = Keyring(current, derive_mac_key(swarm.previous), cfg.previous_key_grace,
                   clock=time.monotonic, used=read_used(path, pid),
                   ids=(swarm.swarm_id, pid), on_used=used, on_retired=retired)
    if keys.retired:
        reporter.info(f"swarm key {swarm.swarm_id}; the previous key (id {pid}) stays refused: "
                      f"its grace is over on this node", event="key_retired", previous_id=pid)
        return keys
    reporter.info(f"key rotation: signing with swarm key {swarm.swarm_id}, also accepting the "
                  f"previous key (id {pid}) for {keys.grace_left():.0f}s of this node's "
                  f"running time", event="key_grace", previous_id=pid,
                  grace_left_s=keys.grace_left())
    loop = asyncio.get_running_loop()

    def tick() -> None:
        if keys.in_grace():
            loop.call_later(min(SAVE_EVERY, keys.grace_left() + 0.01), tick)

    loop.call_later(min(SAVE_EVERY, keys.grace_left() + 0.01), tick)
    return keys
