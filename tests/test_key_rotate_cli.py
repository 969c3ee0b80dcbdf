"""Rotating the swarm key, the operator's side: `p2ptrain key rotate` on the files `init`
wrote (new key, previous key kept, both 0600, the configuration naming both, comments kept),
the swarm a configuration with a previous key names, and the grace of a node saved in its
state directory so that a restart does not open it again."""

from __future__ import annotations

import asyncio
import math
import os
import secrets
import stat
import tomllib

import pytest

from p2ptrain.cli.main import main
from p2ptrain.cli.swarmcmds import swarm_of
from p2ptrain.config import resolve
from p2ptrain.net.keyring import Keyring
from p2ptrain.net.rotation import GRACE_FILE, keyring_of, read_used
from p2ptrain.settings import SwarmConfig
from p2ptrain.swarm import SwarmError, new_swarm, read_key_file, write_init_files


class Said:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, text: str, **kw) -> None:
        self.lines.append((text, kw))

    warn = info


def test_a_restart_does_not_open_the_grace_again(tmp_path):
    swarm = new_swarm("lab").with_previous(new_swarm("lab"))
    said = Said()

    async def keys(grace: float) -> Keyring:
        return keyring_of(swarm, SwarmConfig(previous_key_grace=grace), tmp_path, said)

    first = asyncio.run(keys(0.3))
    assert first.in_grace() and said.lines[-1][1]["event"] == "key_grace"

    def retired() -> bool:
        return any(kw["event"] == "key_retired" for _, kw in said.lines)

    async def run_out() -> None:  # the node's timer ends the grace and logs it
        keyring_of(swarm, SwarmConfig(previous_key_grace=0.3), tmp_path, said)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not retired():  # poll for the timer's event, with a deadline
            assert loop.time() < deadline, "the grace never ended"
            await asyncio.sleep(0.05)

    asyncio.run(run_out())
    assert read_used(tmp_path / GRACE_FILE, swarm.previous_id) == pytest.approx(0.3)
    assert [kw["event"] for _, kw in said.lines].count("key_retired") == 1
    later = asyncio.run(keys(0.3))  # the next life: the grace was used up
    assert later.retired and not later.in_grace()
    assert read_used(tmp_path / GRACE_FILE, "another id") == 0.0
    # a damaged count (an empty file after a power cut, a string) reopened the whole grace
    for damaged in (b"", b'{"previous": "%s", "used": "x"}' % swarm.previous_id.encode(),
                    b"\xff", b"[" * 100_000):  # (nested: a RecursionError traceback)
        (tmp_path / GRACE_FILE).write_bytes(damaged)
        assert read_used(tmp_path / GRACE_FILE, swarm.previous_id) == math.inf, damaged
        assert asyncio.run(keys(3600.0)).retired
    (tmp_path / GRACE_FILE).unlink()  # none at all: a fresh rotation, the whole grace
    assert read_used(tmp_path / GRACE_FILE, swarm.previous_id) == 0.0


CONFIG = """# my fleet
[swarm]
name = "fleet"
key_file = "swarm.key"  # secret: mode 0600

[model]
name = "mlp"   # kept as written
"""


def test_key_rotate_writes_a_new_key_keeps_the_previous_and_names_both(tmp_path, capsys):
    swarm = new_swarm("fleet")
    _, config = write_init_files(swarm, tmp_path / "swarm-fleet", CONFIG)
    assert main(["key", "rotate", "--config", str(config), "--grace", "120"]) == 0
    out = capsys.readouterr().out
    key_file, prev_file = config.parent / "swarm.key", config.parent / "swarm.previous.key"
    for f in (key_file, prev_file):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600
    assert read_key_file(prev_file, "fleet") == swarm
    cfg = resolve(str(config), {}, {})
    now = swarm_of(cfg, str(config))
    assert now.key != swarm.key and now.previous == swarm.key
    assert cfg["swarm.previous_key_grace"] == 120.0
    assert now.token() in out and "one at a time" in out and "real-time clock" in out
    text = config.read_text()
    assert text.startswith("# my fleet\n") and 'name = "mlp"   # kept as written' in text
    assert tomllib.loads(text)["swarm"]["previous_key_file"] == "swarm.previous.key"

    assert main(["key", "rotate", "--config", str(config)]) == 0  # once more: 120 s kept
    out = capsys.readouterr().out
    cfg = resolve(str(config), {}, {})
    again = swarm_of(cfg, str(config))
    assert again.previous == now.key and again.key not in (now.key, swarm.key)
    assert cfg["swarm.previous_key_grace"] == 120.0 and "dropped now" in out
    assert text.count("previous_key_file") == config.read_text().count("previous_key_file")


def test_key_rotate_needs_a_key_file_and_a_previous_key_needs_a_swarm(tmp_path, capsys):
    bare = tmp_path / "bare.toml"
    bare.write_text('[model]\nname = "mlp"\n')
    assert main(["key", "rotate", "--config", str(bare)]) == 2
    assert "names no [swarm] key_file" in capsys.readouterr().err
    alone = tmp_path / "alone.key"
    alone.write_bytes(secrets.token_bytes(32))
    cfg = resolve(None, {"P2PTRAIN_SWARM_PREVIOUS_KEY_FILE": str(alone)}, {})
    with pytest.raises(SwarmError, match="demo swarm"):
        swarm_of(cfg, None)
    swarm = new_swarm("x")
    with pytest.raises(SwarmError, match="nothing was rotated"):
        swarm.with_previous(swarm)


@pytest.mark.parametrize("grace", ["inf", "nan", "-1", "1e300"])
def test_a_grace_that_is_not_a_finite_count_of_seconds_changes_nothing(tmp_path, capsys, grace):
    """--grace inf rotated the key and wrote a config that join then refused; on a second
    rotation a bad grace first said the key before was dropped (it was not)."""
    swarm = new_swarm("fleet")
    _, config = write_init_files(swarm, tmp_path / "swarm-fleet", CONFIG)
    assert main(["key", "rotate", "--config", str(config), "--grace", "60"]) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in config.parent.iterdir()}
    assert main(["key", "rotate", "--config", str(config), "--grace", grace]) == 2
    said = capsys.readouterr()
    assert "--grace" in said.err and "note:" not in said.out
    assert {p.name: p.read_bytes() for p in config.parent.iterdir()} == before


def test_a_rotation_that_cannot_write_says_so_in_one_line_and_keeps_the_key(tmp_path, capsys):
    """A file the rotation must write that cannot be (here the previous key's place is under a
    regular file; a read-only directory for a user) ended in a PermissionError traceback,
    after the note that the key before was dropped."""
    swarm = new_swarm("fleet")
    _, config = write_init_files(swarm, tmp_path / "swarm-fleet", CONFIG)
    (config.parent / "blocked").write_text("a file, not a directory")
    text = config.read_text().replace('key_file = "swarm.key"',
                                      'key_file = "swarm.key"\nprevious_key_file = '
                                      '"blocked/prev.key"', 1)
    config.write_text(text)
    before = (config.parent / "swarm.key").read_bytes()
    assert main(["key", "rotate", "--config", str(config)]) == 2
    said = capsys.readouterr()
    assert "key rotate:" in said.err and "not rotated" in said.err and "Traceback" not in said.err
    assert "dropped now" not in said.out
    assert (config.parent / "swarm.key").read_bytes() == before
