"""A bad disk under the node's state: files that are FIFOs, links to a disk not mounted, a
chunk that cannot be written. Each is refused or reported in one line; none hangs the node,
and none is blamed on a peer. (Found by a review that planted them for real: a FIFO where a
manifest should be hung the start, or the I/O thread and with it the stop.)"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.checkpoint import store
from p2ptrain.errors import UserError
from p2ptrain.lora import basefile
from p2ptrain.lora import setup as lora_setup
from p2ptrain.lora.basefile import BaseError, read_base
from p2ptrain.net import partial
from p2ptrain.net.fetch import FetchError
from p2ptrain.net.rotation import read_used
from p2ptrain.statelock import lock_state_dir
from p2ptrain.swarm import SwarmError, read_key_file
from tests.helpers import cli_env, run_cli
from tests.test_ckptfetch import (  # noqa: F401 (small_chunks: an autouse fixture)
    fetch,
    make_app,
    make_leader,
    save_checkpoint,
    small_chunks,
)

GRACE = 20.0  # s a call may take before it counts as stuck on the FIFO


def without_waiting_on(fifo: Path, call: Callable[[], object]) -> object:
    """`call()`'s result (or its exception, raised here). If it is still running after GRACE s
    it is waiting on `fifo`: a writer is opened and closed to let it go, and the test fails."""
    os.mkfifo(fifo)
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(GRACE)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY))  # the reader sees an end of file
        thread.join(GRACE)
        pytest.fail(f"waited on the FIFO {fifo}")
    if "error" in box:
        raise box["error"]
    return box.get("result")


def test_a_fifo_for_a_checkpoints_manifest_is_passed_over(tmp_path):
    leader = make_leader(tmp_path)
    older = leader.ckroot / leader.ckid
    newer = save_checkpoint(leader.ckroot, leader.ident, step=9)
    (newer / mf.MANIFEST_FILE).unlink()
    with pytest.raises(mf.CheckpointError, match="unreadable manifest .*not a regular file"):
        without_waiting_on(newer / mf.MANIFEST_FILE, lambda: mf.read(newer))
    found = store.find_latest(leader.ckroot, "fp")
    assert found.path == older and any("not a regular file" in s for s in found.skipped)


def test_a_fifo_for_the_key_grace_record_counts_as_damaged(tmp_path):
    used = without_waiting_on(tmp_path / "key-grace.json",
                              lambda: read_used(tmp_path / "key-grace.json", "ab" * 8))
    assert used == float("inf")  # all of the grace used: a damaged record reopens none


def test_a_swarm_key_file_may_be_a_pipe_but_not_an_endless_one(tmp_path):
    """`--key-file <(pass show swarm)` keeps the secret off the disk (a review found this
    session's first version refused it); /dev/zero is refused, not read until memory ends."""
    key = os.urandom(32)
    read, write = os.pipe()
    os.write(write, key)
    os.close(write)
    try:
        assert read_key_file(Path(f"/dev/fd/{read}"), "lab").key == key
    finally:
        os.close(read)
    with pytest.raises(SwarmError, match="swarm key file /dev/zero: larger than 4096 bytes"):
        read_key_file(Path("/dev/zero"), "lab")


def test_a_fifo_for_a_bases_manifest_or_its_index_is_refused(tmp_path):
    (tmp_path / "base").mkdir()
    with pytest.raises(BaseError, match="not a regular file"):
        without_waiting_on(tmp_path / "base" / basefile.MANIFEST,
                           lambda: read_base(tmp_path / "base"))
    root = tmp_path / "bases"
    root.mkdir()
    made = without_waiting_on(root / lora_setup.SOURCES, lambda: lora_setup._made_before(
        root, tmp_path / "hf", "bf16"))
    assert made is None  # a cache: made anew


def test_a_fifo_for_a_downloads_progress_record_falls_back_to_hashing(tmp_path):
    leader = make_leader(tmp_path)
    manifest = mf.read(leader.ckroot / leader.ckid)
    part = tmp_path / "partial"
    part.mkdir()
    have = without_waiting_on(part / partial.PROGRESS_FILE,
                              lambda: partial.resume(part, manifest, mf.DATA_FILES))
    assert have == {n: set() for n in mf.DATA_FILES}  # nothing there: every chunk to fetch


def test_a_state_directory_linked_to_a_disk_not_mounted_says_so(tmp_path):
    (tmp_path / "st").symlink_to(tmp_path / "usb" / "st")
    with pytest.raises(UserError, match=r"st: it is a link to .*usb/st, which does not exist "
                                        r"\(is that disk mounted\?\)"):
        lock_state_dir(tmp_path / "st")


def test_a_checkpoints_link_to_a_disk_not_mounted_is_refused_at_start(tmp_path):
    """The node started from step 0 without a word, then could write no checkpoint."""
    (tmp_path / "st").mkdir()
    (tmp_path / "st" / "checkpoints").symlink_to(tmp_path / "usb" / "checkpoints")
    r = run_cli("join", "--alone", "--state-dir", str(tmp_path / "st"), "--steps", "3",
                env=cli_env())
    assert r.returncode == 2 and "checkpoints: it is a link to " in r.stderr \
        and "which does not exist (is that disk mounted?)" in r.stderr, r.stderr[-800:]
    assert not (tmp_path / "usb").exists()


def test_a_base_linked_to_a_disk_not_mounted_is_named_not_fetched_over(tmp_path):
    """`--base /usb/<id>` links bases/<id>; with the disk gone the join fetched the whole base
    and then failed at its rename (ENOTDIR), at every start."""
    root = tmp_path / "bases"
    root.mkdir()
    (root / "0123456789abcdef").symlink_to(tmp_path / "usb" / "0123456789abcdef")
    with pytest.raises(BaseError, match="0123456789abcdef: it is a link to .*, which does not "
                                        "exist"):
        lora_setup.find_base("0123456789abcdef", [root])
    with pytest.raises(BaseError, match="which does not exist"):  # none of the roots has it
        lora_setup.find_base("0123456789abcdef", [root, tmp_path / "elsewhere"])
    with pytest.raises(lora_setup.BaseMissing):  # once the link is removed: fetched anew
        (root / "0123456789abcdef").unlink()
        lora_setup.find_base("0123456789abcdef", [root])


def test_a_chunk_this_node_cannot_write_ends_the_fetch_in_one_line(tmp_path, caplog):
    """A full or read-only disk: the fetch said '<source>: OSError: ...' (blaming the source)
    and the worker's exception was never retrieved (a traceback in the log)."""
    leader = make_leader(tmp_path)
    out = tmp_path / "out"
    app = make_app(leader)
    target = out / (partial.PARTIAL_PREFIX + leader.ckid) / store.MODEL_FILE

    @_on_first_chunk(app)
    def swap() -> None:
        target.unlink()
        target.mkdir()  # opening it for writing: IsADirectoryError

    caplog.set_level(logging.ERROR, logger="asyncio")
    with pytest.raises(FetchError, match=r"^checkpoint fetch from 127\.0\.0\.1:\d+: cannot write "
                                         r".*model\.safetensors: Is a directory$"):
        fetch(leader, out, app=app)
    gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


def _on_first_chunk(app):
    """Run the decorated function once, when the first chunk is asked for (before it is
    served, so the fetcher's first write meets what it did)."""
    def wrap(fn):
        done = []

        async def middleware_wrapper(request, handler):
            if request.path.endswith(".safetensors") and not done:
                done.append(True)
                fn()
            return await handler(request)

        app.middlewares.append(web.middleware(middleware_wrapper))
        return fn
    return wrap
