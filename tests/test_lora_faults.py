"""LoRA mode's base on a failing disk, damaged after it was made, and fetched from a status
document anything may have written: one error line or a remade base, never a traceback."""

from __future__ import annotations

import asyncio
import errno

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.cli.main import main
from p2ptrain.lora import basefile
from p2ptrain.lora.basefile import BASE_FILE, base_from_init, verify_base
from p2ptrain.models.rwkv import RWKVConfig
from p2ptrain.net import basefetch
from p2ptrain.net.auth import Signer
from p2ptrain.net.fetch import MAX_SOURCES, FetchError
from p2ptrain.net.session import Life
from tests.test_basefetch import KEY, Server, base, fetch  # noqa: F401 (a fixture)

TINY = RWKVConfig(vocab_size=256, n_layer=1, n_embd=16, ctx_len=16)


def _join(tmp_path, source, state="s") -> int:
    return main(["join", "--alone", "--mode", "lora", "--base", str(source), "--state-dir",
                 str(tmp_path / state), "--steps", "1", "--batch", "4"])


def test_an_io_error_checking_the_base_is_one_line(tmp_path, monkeypatch, capsys):
    made = base_from_init(TINY, 0, tmp_path / "bases")

    def failing(path, *args, **kwargs):  # a failing SD card under the base file
        if str(path).endswith(BASE_FILE):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(basefile, "open", failing, raising=False)
    assert _join(tmp_path, made.path) == 2  # was an OSError traceback, exit 1
    err = capsys.readouterr().err
    assert "lora base: Input/output error" in err and "Traceback" not in err, err


def test_a_full_disk_making_the_base_is_one_line(tmp_path, monkeypatch, capsys):
    assert main(["join", "--alone", "--state-dir", str(tmp_path / "full"), "--steps", "1",
                 "--batch", "4"]) == 0  # a checkpoint to make the base of

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(basefile, "write_safetensors", full)
    capsys.readouterr()
    assert _join(tmp_path, tmp_path / "full") == 2
    err = capsys.readouterr().err
    assert "lora base: No space left on device" in err and "Traceback" not in err, err
    assert not list((tmp_path / "s" / "bases").glob(".tmp-*"))  # nothing half-written left


def test_a_base_damaged_since_it_was_made_is_made_anew_from_its_source(tmp_path, capsys):
    """It failed every start, also once made afresh: the new copy was thrown away because a
    directory of its id (the damaged one) was there."""
    assert main(["join", "--alone", "--state-dir", str(tmp_path / "full"), "--steps", "1",
                 "--batch", "4"]) == 0
    assert _join(tmp_path, tmp_path / "full") == 0
    [made] = [p for p in (tmp_path / "s" / "bases").iterdir() if p.is_dir()]
    data = bytearray((made / BASE_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (made / BASE_FILE).write_bytes(bytes(data))
    capsys.readouterr()
    assert _join(tmp_path, tmp_path / "full") == 0, capsys.readouterr().err
    verify_base(basefile.read_base(made))  # whole again, where it was
    assert sorted(p.name for p in (tmp_path / "s" / "bases").iterdir()) == sorted(
        [made.name, "sources.json"])
    (made / BASE_FILE).write_bytes(bytes(data))  # a damaged base named by id: what to do
    capsys.readouterr()
    assert _join(tmp_path, made.name) == 2
    assert f"remove {made}" in capsys.readouterr().err


def test_a_full_disk_during_a_base_fetch_is_a_fetch_error(base, tmp_path, monkeypatch):  # noqa: F811
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(basefetch, "write_chunk", full)
    with pytest.raises(FetchError, match="No space left on device"):
        fetch([Server({base.id: base.path})], base.id, tmp_path / "bases")


def test_a_base_fetch_asks_at_most_max_sources_of_the_addresses_it_is_given(tmp_path):
    """basejoin passes every member a status answer lists (no key needed to answer it):
    200 listed made the joiner connect to 200 at once."""
    seen: set[str] = set()

    async def anything(request):  # each address below is one source: its own query string
        seen.add(request.query_string.split("/")[0])
        return web.Response(status=404)

    async def run():
        app = web.Application()
        app.router.add_get("/{tail:.*}", anything)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with aiohttp.ClientSession() as session:
                with pytest.raises(FetchError):
                    await basefetch.fetch_base(
                        session, [f"127.0.0.1:{port}?{i}" for i in range(200)],
                        Signer(KEY, Life.throwaway(1)), "0123456789abcdef", tmp_path,
                        timeout=5)
        finally:
            await runner.cleanup()

    asyncio.run(run())
    assert 0 < len(seen) <= MAX_SOURCES


def test_a_merge_holds_about_one_tensor_at_a_time(tmp_path):
    """`checkpoint merge --help` says one tensor is in memory at a time; the product of an
    adapted matrix's adapters and its scaled copy were two more of its size (61 MiB for a
    16 MiB matrix), and the writer kept the last tensor while it made the next."""
    import tracemalloc

    import numpy as np

    from p2ptrain import checkpoint
    from p2ptrain.identity import load_or_create
    from p2ptrain.lora.setup import lora_model
    from p2ptrain.models import fingerprint
    from p2ptrain.models.lora import LoRAConfig

    wide = RWKVConfig(vocab_size=256, n_layer=1, n_embd=1024, ctx_len=16)
    made = base_from_init(wide, 1, tmp_path / "state" / "bases", "bf16")
    model = lora_model(made, LoRAConfig(8, 16.0, "blocks.*.ffn.*"), 16, 16)
    flat = model.space.zeros()
    model.init_params(flat, np.random.default_rng(0))
    flat += np.float32(0.01)  # (B starts at zero: a product of zeros would prove nothing)
    snap = checkpoint.Snapshot(step=1, term=0, swarm_count={}, fingerprint=fingerprint(model),
                               arch=model.arch(), model_tensors=list(model.space.views(
                                   flat).items()), state_tensors=[], state_meta={"step": 1})
    checkpoint.save(tmp_path / "state" / "checkpoints", snap,
                    load_or_create(tmp_path / "id"), keep=1)
    largest = max(4 * s.size for s in model.full_space)  # a 1024 x 4096 float32 matrix
    tracemalloc.start()
    try:
        assert main(["checkpoint", "merge", "--adapters", str(tmp_path / "state"), "--out",
                     str(tmp_path / "merged")]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # one tensor and ~18 MiB of fixed buffers (the base's check reads 8 MiB pieces): 34 MiB
    # for a 16 MiB matrix; 54 MiB before
    assert peak < 2.5 * largest, (peak / 2**20, largest / 2**20)


def test_a_base_directory_given_by_path_is_found_by_id_afterwards(tmp_path, capsys):
    """The README says the base is in <state-dir>/bases/<id>: one given as a directory
    elsewhere was used there and not found afterwards -- `sample` of the run's checkpoints
    and a restart with `--base <id>` both failed ('not in .../bases')."""
    made = base_from_init(TINY, 0, tmp_path / "elsewhere")
    assert _join(tmp_path, made.path) == 0
    assert (tmp_path / "s" / "bases" / made.id).resolve() == made.path.resolve()
    assert _join(tmp_path, made.id) == 0  # a restart by id
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(tmp_path / "s"), "--length", "4"]) == 0


def test_the_base_fetch_takes_the_holders_a_status_lists_after_its_other_rows():
    """The cap applied to the rows, before the dead and outbound-only ones were dropped:
    a status listing 32 of those first gave the fetch no holder but the node asked."""
    from p2ptrain.cli.basejoin import MAX_ROWS, holders

    rows = ([{"addr": f"10.0.0.{i}:7100", "state": "alive", "outbound_only": True}
             for i in range(20)]
            + [{"addr": f"10.0.0.{i}:7100", "state": "dead"} for i in range(20, 32)]
            + [{"addr": f"10.0.1.{i}:7100", "state": "alive"} for i in range(40)])
    assert holders({"members": rows}, MAX_SOURCES) == [f"10.0.1.{i}:7100"
                                                       for i in range(MAX_SOURCES)]
    for odd in ({}, {"members": 7}, {"members": [5, None, {"addr": 3, "state": "alive"}]}):
        assert holders(odd, MAX_SOURCES) == []
    many = [{"addr": "10.0.0.1:1", "state": "dead"}] * MAX_ROWS + rows  # rows read: bounded
    assert holders({"members": many}, MAX_SOURCES) == []


def test_a_damaged_base_directory_of_the_users_own_is_named_not_to_be_removed(tmp_path,
                                                                              capsys):
    """Only a base the node made or fetched is to be removed (it comes back); the user's
    own base directory, damaged, is said to be so -- not 'remove' it."""
    made = base_from_init(TINY, 0, tmp_path / "mine")
    data = bytearray((made.path / BASE_FILE).read_bytes())
    data[len(data) // 2] ^= 1
    (made.path / BASE_FILE).write_bytes(bytes(data))
    assert _join(tmp_path, made.path) == 2
    err = capsys.readouterr().err
    assert "is damaged" in err and "remove" not in err and "Traceback" not in err, err
