"""A fetch against sources that misbehave in ways a MAC does not stop (a review's findings,
2026-12-05): a non-ASCII MAC header, an answer trickled a byte at a time, partial holders left
alone once the whole holder is dropped, `have` runs that overlap, and ranges that a client
never reads. Real aiohttp servers on 127.0.0.1 (tests/test_ckptfetch.py's leader fixture);
each case fails on the code before the fix."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.identity import load_or_create
from p2ptrain.net import ckptserve
from p2ptrain.net import fetch as fetchmod
from p2ptrain.net.auth import MAC, AuthError, ServerAuth, Signer
from p2ptrain.net.ckptserve import Serving, add_checkpoint_routes, describe
from p2ptrain.net.fetch import FetchError, NoCheckpoint, check_answer, fetch_checkpoint
from p2ptrain.net.hello import add_hello_route
from p2ptrain.net.joinflow import JoinFetcher
from p2ptrain.net.session import Life
from p2ptrain.net.shelf import Held, Shelf
from p2ptrain.proto.events import CheckpointFetched, FetchCheckpoint
from tests.test_ckptfetch import (  # noqa: F401 (small_chunks: an autouse fixture)
    CLIENT_ID,
    CLIENT_KEY,
    INCARNATIONS,
    KEY,
    Leader,
    make_app,
    make_leader,
    raw_get,
    serving,
    small_chunks,
)

NON_ASCII = "\u00e9" * 64  # what aiohttp hands over for a header of Latin-1 bytes


@pytest.fixture
def leader(tmp_path) -> Leader:
    return make_leader(tmp_path)


def _signer() -> Signer:
    return Signer(KEY, Life.throwaway(next(INCARNATIONS), CLIENT_KEY))


class _Quiet:
    """A reporter that says nothing."""

    def info(self, *a, **k):
        pass

    warn = info


def _member_app(tmp_path, name: str, route) -> web.Application:
    """A key holder that answers hello honestly and `/v1/checkpoint/{id}` with `route`."""
    me = load_or_create(tmp_path / name)
    auth = ServerAuth(KEY, Life(me))
    app = web.Application()
    add_hello_route(app, auth)

    async def handler(request):
        return await route(request, auth)

    app.router.add_get("/v1/checkpoint/{id}", handler)
    return app


async def _fetch_from(apps, tmp_path, leader_id, **kw):
    """(what the fetch got, the sources' addresses in the order of `apps`)."""
    async with servers(apps) as bases, aiohttp.ClientSession() as session:
        addrs = [b.removeprefix("http://") for b in bases]
        return await fetch_checkpoint(session, addrs, _signer(), tmp_path / "out",
                                      expected_leader=leader_id, **kw), addrs


@contextlib.asynccontextmanager
async def servers(apps):
    """Serve several apps at once (`serving` each): their base URLs."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serving(app)) for app in apps]


def test_a_non_ascii_mac_is_refused_as_a_bad_mac_not_a_crash(leader, tmp_path):
    """compare_digest raises TypeError on non-ASCII text: it escaped every handler, so one
    hostile answer killed the fetch (and a joiner's fetch task, which then never answered)."""
    signer = _signer()
    with pytest.raises(AuthError):
        signer.check_welcome("0" * 32, {MAC: NON_ASCII}, b"{}")

    async def hello_route(request):
        return web.Response(body=b"{}", headers={MAC: NON_ASCII})

    stranger = web.Application()  # no key needed to answer a hello
    stranger.router.add_get("/v1/hello", hello_route)
    with pytest.raises(FetchError, match="hello"):
        asyncio.run(_fetch_from([stranger], tmp_path, None))

    held = leader.shelf.latest()

    async def bad_mac(request, auth):
        rid = auth.verify(request.method, request.path, request.headers, b"")
        body = json.dumps(describe(held)).encode()
        headers = auth.sign("GET", request.path, rid, 200, body)
        headers[MAC] = NON_ASCII
        return web.Response(body=body, headers=headers)

    got, (lead, member) = asyncio.run(_fetch_from(
        [make_app(leader), _member_app(tmp_path, "m", bad_mac)], tmp_path,
        leader.ident.node_id, timeout=5))
    assert got.manifest.id == leader.ckid  # the leader served it all
    assert got.served[lead] == len(got.manifest.chunks()) and not got.served.get(member)


def test_a_joiners_fetch_always_answers(leader, tmp_path, monkeypatch):
    """The node waits in `fetching` for this answer with no deadline of its own."""
    async def broken(*args, **kwargs):
        raise RuntimeError("a defect")

    monkeypatch.setattr("p2ptrain.net.joinflow.fetch_checkpoint", broken)
    answers = []

    async def run():
        async with aiohttp.ClientSession() as session:
            signer = _signer()
            fetcher = JoinFetcher(session, lambda: signer, tmp_path / "st", "fp", None,
                                  answers.append, _Quiet(), None, None, Shelf(lambda: []),
                                  lambda leader_id, digest: [])
            fetcher.start(FetchCheckpoint(leader.ident.node_id, ("127.0.0.1:9",), 1))
            await asyncio.wait_for(fetcher.task, 30)

    asyncio.run(run())
    assert len(answers) == 1 and answers[0].path is None and answers[0].retry, answers
    assert "RuntimeError: a defect" in answers[0].reason


def test_a_joiners_fetch_signs_as_the_node_signs_now(leader, tmp_path, monkeypatch):
    """A node that switches to outbound-only mid-join goes on under a new incarnation (a new
    life); its peers refuse the old one from then on, so the join's next fetch must use the
    node's signer of that moment, not the one it had when the fetcher was made."""
    used = []

    async def record(session, sources, signer, *args, **kwargs):
        used.append(signer() if callable(signer) else signer)  # whom it signs as at the start
        raise RuntimeError("recorded")

    monkeypatch.setattr("p2ptrain.net.joinflow.fetch_checkpoint", record)

    node = {"signer": _signer()}
    first = node["signer"]

    async def run():
        async with aiohttp.ClientSession() as session:
            fetcher = JoinFetcher(session, lambda: node["signer"], tmp_path / "st", "fp", None,
                                  lambda answer: None, _Quiet(), None, None, Shelf(lambda: []),
                                  lambda leader_id, digest: [])
            for _ in range(2):
                fetcher.start(FetchCheckpoint(leader.ident.node_id, ("127.0.0.1:9",), 1))
                await asyncio.wait_for(fetcher.task, 30)
                node["signer"] = _signer()  # the switch: a new life

    asyncio.run(run())
    assert used[0] is first and used[1] is not first and used[1].incarnation > first.incarnation


def test_a_trickled_answer_neither_holds_the_start_nor_lasts(leader, tmp_path):
    """A member trickling its `{id, manifest, have}` answer under the read timeout held the
    fetch at step 2 for ever (a joiner: its 600 s deadline, every attempt)."""
    trickled = []

    async def trickle(request, auth):
        auth.verify(request.method, request.path, request.headers, b"")
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        trickled.append(request.path)
        with contextlib.suppress(ConnectionError):  # until the client gives up
            for _ in range(600):
                await resp.write(b" ")
                await asyncio.sleep(0.5)
        return resp

    async def run():
        task = asyncio.ensure_future(_fetch_from(
            [make_app(leader), _member_app(tmp_path, "slow", trickle)], tmp_path,
            leader.ident.node_id, timeout=3))
        return await asyncio.wait_for(task, 60)

    got, (lead, member) = asyncio.run(run())  # from the leader while the member trickled
    assert got.manifest.id == leader.ckid and trickled
    assert got.served[lead] == len(got.manifest.chunks()) and not got.served.get(member)


def test_a_fetch_left_with_partial_holders_lacking_a_chunk_ends(leader, tmp_path, monkeypatch):
    """The whole holder dropped (its chunk connections cut), a partial holder without the
    rest: the fetch spun for ever (a joiner until its deadline, the CLI for good)."""
    monkeypatch.setattr(fetchmod, "STALL", 2.0)
    leader.cut_after = 0
    me = load_or_create(tmp_path / "partial")
    auth = ServerAuth(KEY, Life(me))
    held = leader.shelf.latest()
    shelf = Shelf(lambda: [])
    shelf.register(Held(held.path, held.manifest, {mf.MODEL_FILE: {0}, mf.STATE_FILE: set()}))
    partial = web.Application()
    add_hello_route(partial, auth)
    add_checkpoint_routes(partial, Serving(shelf, auth))

    async def run():
        return await asyncio.wait_for(_fetch_from(
            [make_app(leader), partial], tmp_path, leader.ident.node_id,
            files=(mf.MODEL_FILE,), timeout=3), 60)

    with pytest.raises(FetchError, match="no chunk for 2s"):
        asyncio.run(run())


def test_have_runs_must_be_in_order_and_apart(leader):
    """n copies of [0, n] cost n^2 set insertions on the event loop, every refresh."""
    held = leader.shelf.latest()
    doc = describe(held)
    n = len(held.manifest.files[mf.MODEL_FILE].hashes)
    doc["have"] = {mf.MODEL_FILE: [[0, 2], [2, n]], mf.STATE_FILE: []}  # touching: fine
    assert check_answer(json.loads(json.dumps(doc)))[2][mf.MODEL_FILE] == set(range(n))
    for runs in ([[0, n], [0, n]], [[2, 3], [0, 1]], [[0, 2], [1, 3]]):
        doc["have"] = {mf.MODEL_FILE: runs, mf.STATE_FILE: []}
        with pytest.raises(FetchError, match="malformed"):
            check_answer(json.loads(json.dumps(doc)))


def test_a_range_is_streamed_from_disk_a_piece_at_a_time(leader, monkeypatch):
    """A range was read whole into memory (up to 16 MiB) and held until the client read it:
    40 requests that were never read took a server from 87 to 741 MiB. Now it is MACed over
    a mapping and read from the file a PIECE at a time as the client takes it."""
    monkeypatch.setattr(ckptserve, "PIECE", 4096)
    reads = []
    pread = ckptserve._pread_exact

    def recording(fd, length, offset):
        reads.append(length)
        return pread(fd, length, offset)

    monkeypatch.setattr(ckptserve, "_pread_exact", recording)
    size = leader.shelf.latest().manifest.files[mf.MODEL_FILE].size

    async def run():
        async with serving(make_app(leader)) as base, aiohttp.ClientSession() as session:
            signer = _signer()
            path = f"/v1/checkpoint/{leader.ckid}/{mf.MODEL_FILE}"
            status, headers, body, rid = await raw_get(session, base, path, signer,
                                                       {"Range": "bytes=5-"})
            signer.check_response("GET", path, rid, status, headers, body)  # MAC holds
            return status, body

    status, body = asyncio.run(run())
    assert status == 206 and len(body) == min(size - 5, ckptserve.MAX_RANGE)
    with open(leader.shelf.latest().path / mf.MODEL_FILE, "rb") as f:
        f.seek(5)
        assert body == f.read(len(body))
    assert reads and max(reads) <= 4096 and sum(reads) == len(body)


def test_a_source_without_a_checkpoint_is_named_once(leader, tmp_path):
    """"checkpoint fetch from A: A: no checkpoint to fetch (...)" named the leader twice."""
    empty = Leader(leader.ident, tmp_path / "none", leader.ckid, leader.tensors, leader.auth)
    empty.shelf = Shelf(lambda: [])

    async def run():
        return await _fetch_from([make_app(empty)], tmp_path, leader.ident.node_id)

    with pytest.raises(NoCheckpoint) as err:
        asyncio.run(run())
    text = str(err.value)
    addr = text.removeprefix("checkpoint fetch from ").split(": ", 1)[0]
    assert text.count(addr) == 1 and "no checkpoint to fetch" in text, text


def test_a_holder_slow_to_say_what_it_holds_is_not_connected_twice(leader, tmp_path,
                                                                    monkeypatch):
    """Other holders are now asked in the background; one slower than SOURCE_POLL was not yet
    among the sources, so `more_sources` naming it connected a second Source: another hello
    and three more requests in flight to the same peer (a review's test)."""
    monkeypatch.setattr(fetchmod, "SOURCE_POLL", 0.2)
    held = leader.shelf.latest()
    hellos = []

    async def slow(request, auth):
        rid = auth.verify(request.method, request.path, request.headers, b"")
        await asyncio.sleep(2.0)
        body = json.dumps(describe(held)).encode()
        return web.Response(body=body, headers=auth.sign("GET", request.path, rid, 200, body))

    member = _member_app(tmp_path, "slow", slow)

    @web.middleware
    async def count(request, handler):
        if request.path == "/v1/hello":
            hellos.append(request.path)
        return await handler(request)

    member.middlewares.append(count)
    lead = make_app(leader)

    @web.middleware
    async def slow_chunks(request, handler):
        if request.path.endswith("safetensors"):
            await asyncio.sleep(1.0)
        return await handler(request)

    lead.middlewares.append(slow_chunks)

    async def run():
        async with servers([lead, member]) as bases, \
                aiohttp.ClientSession() as session:
            addrs = [b.removeprefix("http://") for b in bases]
            return await fetch_checkpoint(session, addrs, _signer(), tmp_path / "out",
                                          expected_leader=leader.ident.node_id,
                                          more_sources=lambda digest: addrs, timeout=10)

    got = asyncio.run(run())
    assert got.manifest.id == leader.ckid and len(hellos) == 1, hellos


def test_a_joiners_fetch_from_a_leader_that_stopped_ends_once_another_leads(leader, tmp_path,
                                                                            monkeypatch):
    """A leader paused mid-serve (its connections open, no byte coming) held its joiner for
    2.5 minutes -- the chunks' read timeouts times the source's failures -- while a new leader
    led within 2 s. The fetch now ends once the node sees another leader, to be asked again."""
    monkeypatch.setattr("p2ptrain.net.joinflow.LEADER_POLL", 0.05)
    stalled, resumed = asyncio.Event(), asyncio.Event()

    @web.middleware
    async def paused(request, handler):  # the manifest is served; the chunks never come
        if request.path.endswith(".safetensors"):
            stalled.set()
            await resumed.wait()
        return await handler(request)

    app = make_app(leader)
    app.middlewares.append(paused)
    answers, view, polls = [], {"leader": leader.ident.node_id}, []

    def leader_now() -> str | None:
        polls.append(view["leader"])
        return view["leader"]

    async def run():
        async with serving(app) as base, aiohttp.ClientSession() as session:
            fetcher = JoinFetcher(session, _signer, tmp_path / "st", "fp", None, answers.append,
                                  _Quiet(), None, None, Shelf(lambda: []),
                                  lambda leader_id, digest: [], leader_now)
            fetcher.start(FetchCheckpoint(leader.ident.node_id, (base.removeprefix("http://"),),
                                          1))
            await asyncio.wait_for(stalled.wait(), 30)
            view["leader"] = None  # a lapse: nobody known yet -- the fetch goes on
            for _ in range(600):  # (30 s at most) until it has looked three times
                if polls.count(None) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert polls.count(None) >= 3 and not fetcher.task.done()
            view["leader"] = "ab" * 16  # the swarm's new leader
            await asyncio.wait_for(fetcher.task, 30)
            resumed.set()  # (else the server's cleanup waits for its handlers)

    asyncio.run(run())
    fetched = [a for a in answers if isinstance(a, CheckpointFetched)]
    assert len(fetched) == 1 and fetched[0].path is None and fetched[0].retry, answers
    assert "no longer leads" in fetched[0].reason, fetched[0].reason
