"""A LoRA swarm's base fetched from every member that serves it (real aiohttp servers on
127.0.0.1): checked against the id known in advance, chunks from all sources, a source
serving other bytes or another base named and dropped, ranges only, nothing half-written;
and a real node that joins with only the base's id fetches it and trains."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.lora import basefile
from p2ptrain.lora.basefile import BASE_FILE, base_from_init, read_base, verify_base
from p2ptrain.models.rwkv import RWKVConfig
from p2ptrain.net import fetch as fetchmod
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.basefetch import fetch_base
from p2ptrain.net.baseserve import BaseServing, add_base_routes
from p2ptrain.net.fetch import FetchError, Source, _connect, _get
from p2ptrain.net.hello import add_hello_route
from p2ptrain.net.pacing import TokenBucket
from p2ptrain.net.session import Life
from tests.swarmlab import SwarmLab, free_ports, wait_for
from tests.test_ckptfetch import serving

KEY = derive_mac_key(bytes(range(32)))
SHAPE = RWKVConfig(n_layer=2, n_embd=64, ctx_len=16)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 285 KB base in 16 KiB chunks (18 of them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(basefile, "chunk_size_for", lambda nbytes: 16 * 1024)
        return base_from_init(SHAPE, 5, tmp_path_factory.mktemp("bases"), "bf16")


class Server:
    def __init__(self, bases: dict[str, Path], rate: float = 0):
        self.bases, self.bucket, self.served = bases, TokenBucket(rate), 0
        self.runner: web.AppRunner | None = None
        self.addr = ""

    async def start(self) -> None:
        app = web.Application()
        auth = ServerAuth(KEY, Life.throwaway(1))
        add_hello_route(app, auth)
        add_base_routes(app, BaseServing(auth, lambda: self.bases, self.bucket,
                                         on_served=self.count))
        self.runner = web.AppRunner(app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.addr = f"127.0.0.1:{self.runner.addresses[0][1]}"

    def count(self, n: int) -> None:
        self.served += n


def fetch(servers: list[Server], base_id: str, out: Path, addrs: list[str] | None = None,
          bound: float | None = None):
    async def run():
        try:
            for s in servers:
                await s.start()
            async with aiohttp.ClientSession() as session:
                return await asyncio.wait_for(fetch_base(
                    session, addrs or [s.addr for s in servers],
                    Signer(KEY, Life.throwaway(1)), base_id, out), bound)
        finally:
            for s in servers:
                if s.runner is not None:
                    await s.runner.cleanup()
    return asyncio.run(run())


def test_a_base_comes_from_every_server_checked_against_its_id(base, tmp_path):
    servers = [Server({base.id: base.path}, rate=4e6) for _ in range(3)]
    got = fetch(servers, base.id, tmp_path / "bases")
    assert got.id == base.id and got.path == tmp_path / "bases" / base.id
    verify_base(got)
    assert (got.path / BASE_FILE).read_bytes() == (base.path / BASE_FILE).read_bytes()
    assert all(s.served > 0 for s in servers), [s.served for s in servers]
    assert sum(s.served for s in servers) == base.size  # each chunk fetched once
    assert [p.name for p in (tmp_path / "bases").iterdir()] == [base.id]


def test_a_server_with_rotten_bytes_is_dropped_and_named(base, tmp_path):
    rotten = tmp_path / "rotten" / base.id
    shutil.copytree(base.path, rotten)
    data = bytearray((rotten / BASE_FILE).read_bytes())
    for i in range(1000, len(data), 7919):
        data[i] ^= 0xFF  # every chunk damaged
    (rotten / BASE_FILE).write_bytes(bytes(data))
    honest, liar = Server({base.id: base.path}), Server({base.id: rotten})
    got = fetch([liar, honest], base.id, tmp_path / "bases")
    verify_base(got)
    assert honest.served > 0


def test_a_broken_off_fetch_resumes_where_it_stopped(base, tmp_path):
    half = tmp_path / "half" / base.id
    shutil.copytree(base.path, half)
    data = bytearray((half / BASE_FILE).read_bytes())
    for i in range(len(data) // 2, len(data), 7919):
        data[i] ^= 0xFF  # the second half rotten: the only source is dropped there
    (half / BASE_FILE).write_bytes(bytes(data))
    with pytest.raises(FetchError, match="not fetched"):
        fetch([Server({base.id: half})], base.id, tmp_path / "bases")
    partial = tmp_path / "bases" / f".partial-base-{base.id}"
    assert partial.is_dir() and not (tmp_path / "bases" / base.id).exists()
    honest = Server({base.id: base.path})
    got = fetch([honest], base.id, tmp_path / "bases")
    verify_base(got)
    assert 0 < honest.served < base.size  # only what the first fetch did not get right
    assert not partial.exists()


def test_servers_trickling_bytes_cannot_hold_the_fetch(base, tmp_path, monkeypatch):
    """Two servers sending ~0.5 KB/s (a 16 KiB chunk in ~100 s; the read timeout never
    fires) start first; each of their requests is given up at its allowance and the honest
    server serves the rest. Without the allowance the fetch waits for the tricklers."""
    monkeypatch.setattr(fetchmod, "GRACE", 1.0)  # fetch.py's rule, which the base fetch uses
    tricklers = [Server({base.id: base.path}, rate=500) for _ in range(2)]
    honest = Server({base.id: base.path}, rate=4e6)

    got = fetch([*tricklers, honest], base.id, tmp_path / "bases", bound=120)
    verify_base(got)
    assert honest.served >= base.size - 2 * 3 * 16 * 1024, (honest.served, base.size)


def test_another_base_or_none_is_refused(base, tmp_path):
    other = base_from_init(SHAPE, 6, tmp_path / "other", "bf16")  # 256 KiB chunks
    impostor = Server({base.id: other.path})  # serves another base under our id
    with pytest.raises(FetchError, match="manifest of another base"):
        fetch([impostor], base.id, tmp_path / "bases")
    with pytest.raises(FetchError, match=f"has no base {base.id}"):
        fetch([Server({})], base.id, tmp_path / "bases")
    assert not (tmp_path / "bases").exists() or not any((tmp_path / "bases").iterdir())


def test_ranges_only_and_names_checked(base, tmp_path):
    server = Server({base.id: base.path})

    async def run():
        await server.start()
        try:
            async with aiohttp.ClientSession() as session:
                # no MAC: 401; the route names are checked before any file is opened
                async with session.get(f"http://{server.addr}/v1/base/{base.id}") as r:
                    assert r.status == 401
                src = Source(server.addr)
                await _connect(session, src, Signer(KEY, Life.throwaway(1)), 10)
                whole = await _get(src.conn, f"/v1/base/{base.id}/{BASE_FILE}", 206, 1 << 20,
                                   None)
                assert whole.status == 416  # a base is served in ranges only
                bad = await _get(src.conn, f"/v1/base/{base.id}/../../etc", 206, 1 << 20, None)
                assert bad.status == 404
                dots = await _get(src.conn, "/v1/base/..%2F..%2Fx", 200, 1 << 20, None)
                assert dots.status == 404
        finally:
            await server.runner.cleanup()
    asyncio.run(run())


@pytest.mark.slow
def test_a_node_with_only_the_base_id_fetches_it_and_trains(base, tmp_path):
    toml = (f'[model]\nname = "rwkv"\n[model.rwkv]\nn_layer = {SHAPE.n_layer}\n'
            f"n_embd = {SHAPE.n_embd}\nctx_len = {SHAPE.ctx_len}\n[train]\nbatch = 4\n"
            "total_samples = 100000000\n[eval]\nwindows = 8\nevery_seconds = 2\n"
            '[net]\ntiming = "local"\n[checkpoint]\nevery_seconds = 2\n')
    with SwarmLab(tmp_path, toml) as lab:
        ports = free_ports(3)
        addrs = [f"127.0.0.1:{p}" for p in ports]
        holders = [lab.start(f"h{i}", ports[i], [addrs[1 - i]], "--mode", "lora", "--base",
                             str(base.path)) for i in range(2)]
        wait_for("both holders to train", lambda: all(
            p.status().get("step", 0) > 0 for p in holders), 60)
        joiner = lab.start("j", ports[2], addrs[:2], "--mode", "lora", "--base", base.id)
        events = wait_for("the joiner to train", lambda: (
            joiner.status().get("step", 0) > 0 and joiner.events()), 90)
        kinds = [e.get("event") for e in events]
        assert "base_fetched" in kinds, joiner.output()[-3000:]
        fetched = read_base(joiner.state_dir / "bases" / base.id)
        assert fetched.id == base.id
        assert (fetched.path / BASE_FILE).read_bytes() == (base.path / BASE_FILE).read_bytes()
        assert joiner.status()["members"] and all(p.alive() for p in [*holders, joiner])


def test_a_damaged_base_on_disk_is_a_clear_error_not_a_traceback(tmp_path):
    import types

    from p2ptrain.cli.basejoin import missing_base
    from p2ptrain.errors import UserError

    cfg = RWKVConfig(vocab_size=256, n_layer=1, n_embd=16, ctx_len=16)
    made = base_from_init(cfg, 0, tmp_path / "bases")
    f = made.path / BASE_FILE
    f.write_bytes(f.read_bytes()[:100])  # a bad disk: truncated
    settings = types.SimpleNamespace(
        lora=types.SimpleNamespace(base=made.id), init_from="",
        train=types.SimpleNamespace(mode="lora"), host=types.SimpleNamespace(state_dir=tmp_path))
    with pytest.raises(UserError, match="damaged: remove its directory"):
        missing_base(settings)


def test_a_trickled_manifest_is_given_up_and_the_next_server_asked(base, tmp_path):
    """A member answering `GET /v1/base/{id}` a byte at a time, under the read timeout, held
    the fetch for good (the CLI's `join --base ID`, a joiner's base fetch)."""
    me = ServerAuth(KEY, Life.throwaway(1))

    async def trickle(request):
        me.verify(request.method, request.path, request.headers, b"")
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(600):
                await resp.write(b" ")
                await asyncio.sleep(0.5)
        return resp

    honest = Server({base.id: base.path})

    async def run():
        app = web.Application()
        add_hello_route(app, me)
        app.router.add_get("/v1/base/{id}", trickle)
        async with serving(app) as slow:
            try:
                await honest.start()
                async with aiohttp.ClientSession() as session:
                    return await asyncio.wait_for(fetch_base(
                        session, [slow.removeprefix("http://"), honest.addr],
                        Signer(KEY, Life.throwaway(1)), base.id, tmp_path / "bases",
                        timeout=2.0), 60)
            finally:
                await honest.runner.cleanup()

    verify_base(asyncio.run(run()))
    assert honest.served == base.size
