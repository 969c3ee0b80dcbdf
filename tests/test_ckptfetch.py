"""Checkpoint serving and fetching over real aiohttp servers on 127.0.0.1 (port 0).

Checkpoints are small (64 KiB chunks: a 4-chunk model file and a 2-chunk state file), so every
test runs in well under a second. Request counts come from a middleware, never from timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import aiohttp
import numpy as np
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from safetensors.numpy import load_file
from yarl import URL

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.checkpoint import store
from p2ptrain.identity import Identity, load_or_create
from p2ptrain.net import ckptserve
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key, response_headers
from p2ptrain.net.ckptserve import RangeError, Serving, add_checkpoint_routes, parse_range
from p2ptrain.net.fetch import (
    PARTIAL_PREFIX,
    FetchError,
    check_answer,
    fetch_checkpoint,
    fetch_latest,
)
from p2ptrain.net.hello import add_hello_route, hello
from p2ptrain.net.session import Life
from p2ptrain.net.shelf import Shelf
from tests.helpers import introduce

CHUNK = 64 * 1024
KEY = derive_mac_key(bytes(range(32)))
OTHER_KEY = derive_mac_key(bytes(range(1, 33)))
CLIENT_KEY = Ed25519PrivateKey.generate()  # the fetching client's identity, any life
CLIENT_ID = Life.throwaway(1, CLIENT_KEY).node_id
INCARNATIONS = itertools.count(1)
ARABIC_ZERO = "\u0660"  # a Unicode digit: `\d` matches it, a checkpoint name must not


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(store, "CHUNK_SIZE", CHUNK)


@dataclass
class Leader:
    ident: Identity
    ckroot: Path
    ckid: str  # the checkpoint it serves
    tensors: dict[str, np.ndarray]
    auth: ServerAuth
    counts: dict[str, int] = field(default_factory=lambda: {"manifest": 0, "chunks": 0})
    cut_after: int | None = None  # drop the connection of every chunk request after this many
    shelf: Shelf | None = None  # what it serves (its checkpoint root)

    def __post_init__(self):
        self.shelf = Shelf(lambda: [self.ckroot])


def save_checkpoint(ckroot: Path, ident: Identity, seed: int = 0, step: int = 7) -> Path:
    rng = np.random.default_rng(seed)
    model = [("w", rng.normal(size=(300, 200)).astype(np.float32)),
             ("b", rng.normal(size=(200,)).astype(np.float32))]
    snap = store.Snapshot(step=step, term=2, swarm_count={ident.node_id: 40}, fingerprint="fp",
                          arch={"model": "test"}, model_tensors=model,
                          state_tensors=[("adam.m", rng.normal(size=(100, 200)).astype(
                              np.float32))], state_meta={"step": step})
    return store.save(ckroot, snap, ident, keep=3)


@pytest.fixture
def leader(tmp_path) -> Leader:
    return make_leader(tmp_path)


def make_leader(tmp_path: Path) -> Leader:
    """A leader's identity and one saved checkpoint under `tmp_path` (not yet served)."""
    ident = load_or_create(tmp_path / "leader")
    ckroot = tmp_path / "leader" / "checkpoints"
    path = save_checkpoint(ckroot, ident)
    files = store.read_manifest(path).files
    assert len(files[store.MODEL_FILE].hashes) == 4
    assert len(files[store.STATE_FILE].hashes) == 2
    return Leader(ident, ckroot, path.name, load_file(str(path / store.MODEL_FILE)),
                  ServerAuth(KEY, Life(ident)))


def make_app(lead: Leader, allow=None) -> web.Application:
    @web.middleware
    async def count(request: web.Request, handler):
        if request.path == "/v1/checkpoint":
            lead.counts["manifest"] += 1
        elif request.path.endswith("safetensors"):
            lead.counts["chunks"] += 1
            if lead.cut_after is not None and lead.counts["chunks"] > lead.cut_after:
                request.transport.close()  # the leader vanishes mid-fetch
        return await handler(request)

    app = web.Application(middlewares=[count])
    add_hello_route(app, lead.auth, allow=allow)  # every request names its receiver
    add_checkpoint_routes(app, Serving(lead.shelf, lead.auth))
    return app


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def fetch(lead: Leader, out: Path, *, key: bytes = KEY, expected: str | None = "leader",
          app: web.Application | None = None, **kw) -> Path:
    """Serve `lead` (or `app`) and fetch from it once, in a fresh event loop."""
    async def run() -> Path:
        async with serving(app or make_app(lead)) as base, aiohttp.ClientSession() as session:
            who = lead.ident.node_id if expected == "leader" else expected
            # as if the client restarted
            signer = Signer(key, Life.throwaway(next(INCARNATIONS), CLIENT_KEY))
            return await fetch_latest(session, base, signer, out,
                                      expected_leader=who, **kw)
    return asyncio.run(run())


async def raw_get(session, base: str, path: str, signer: Signer | None,
                  headers: dict | None = None, data: bytes | None = None):
    """One request with hand-made headers; (status, headers, body, request id)."""
    url = URL(base + path, encoded=True)
    if signer is not None:
        rid, auth_headers = signer.sign_request("GET", url.path,
                                                to=await hello(session, base, signer))
    else:
        rid, auth_headers = None, {}
    async with session.get(url, headers={**auth_headers, **(headers or {})}, data=data) as r:
        return r.status, r.headers, await r.read(), rid


def test_fetch_returns_a_checkpoint_equal_to_the_leaders(leader, tmp_path):
    seen = []
    out = fetch(leader, tmp_path / "out", progress=lambda done, total: seen.append((done, total)))
    assert out == tmp_path / "out" / leader.ckid
    got = load_file(str(out / store.MODEL_FILE))
    assert got.keys() == leader.tensors.keys()
    for name, tensor in leader.tensors.items():
        np.testing.assert_array_equal(got[name], tensor)
    assert store.read_manifest(out) == store.read_manifest(leader.ckroot / leader.ckid)
    assert (out / store.STATE_FILE).read_bytes() == (
        leader.ckroot / leader.ckid / store.STATE_FILE).read_bytes()
    total = seen[-1][1]
    assert len(seen) == 6 and seen[-1] == (total, total)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [leader.ckid]
    assert sorted(p.name for p in out.iterdir()) == sorted(ckptserve.SERVED_FILES)
    # fetching again finds it in place: the manifest is asked for, no chunk is
    assert fetch(leader, tmp_path / "out") == out and leader.counts == {"manifest": 2,
                                                                         "chunks": 6}


def test_a_wrong_swarm_key_is_refused_with_401(leader, tmp_path):
    with pytest.raises(FetchError, match="refused our authentication.*401") as err:
        fetch(leader, tmp_path / "out", key=OTHER_KEY)
    assert leader.counts["chunks"] == 0 and not (tmp_path / "out").exists()
    assert str(err.value).count("swarm key") == 1, err.value  # asked once, not twice


def test_a_refusal_warning_asks_about_the_key_once():
    from p2ptrain.net.refusals import RefusalWatch

    said: list[str] = []
    watch = RefusalWatch(60.0, lambda: 0.0, said.append, said.append)
    watch.refused("10.0.0.2:7100", "hello MAC does not verify (wrong swarm key?)")
    watch.refused("10.0.0.3:7100", "request MAC does not verify")
    watch = RefusalWatch(60.0, lambda: 0.0, said.append, said.append)
    watch.refused("10.0.0.3:7100", "request MAC does not verify")
    assert [w.count("swarm key") for w in said] == [1, 1], said


def test_requests_without_mac_or_replayed_get_401_and_a_body_gets_400(leader):
    async def run():
        async with serving(make_app(leader)) as base, aiohttp.ClientSession() as session:
            file = f"/v1/checkpoint/{leader.ckid}/{store.MODEL_FILE}"
            for path in ("/v1/checkpoint", file):
                status, _, body, _ = await raw_get(session, base, path, None)
                assert status == 401 and json.loads(body) == {"error": "request carries no MAC"}
            signer = Signer(KEY, Life.throwaway(1, CLIENT_KEY))
            url = URL(base + "/v1/checkpoint")
            rid, headers = signer.sign_request("GET", url.path,
                                               to=await hello(session, base, signer))
            for want in (200, 401):  # the same headers twice: the second is a replay
                async with session.get(url, headers=headers) as r:
                    assert r.status == want
                    body = await r.read()
            assert "replay" in json.loads(body)["error"]
            status, headers, body, rid = await raw_get(session, base, file, signer, data=b"x")
            assert status == 400
            signer.check_response("GET", file, rid, 400, headers, body)
    asyncio.run(run())


def test_a_chunk_rotted_on_the_leaders_disk_is_refused_and_nothing_lands(leader, tmp_path):
    assert leader.shelf.latest().id == leader.ckid  # verified once, then trusted
    with open(leader.ckroot / leader.ckid / store.MODEL_FILE, "r+b") as f:
        f.seek(2 * CHUNK + 100)
        byte = f.read(1)
        f.seek(2 * CHUNK + 100)
        f.write(bytes([byte[0] ^ 0x01]))
    rotted = (r"no holder left .*served model.safetensors chunk 2 with bytes that do not "
              r"match the manifest")
    with pytest.raises(FetchError, match=rotted):
        fetch(leader, tmp_path / "out")
    assert not (tmp_path / "out" / leader.ckid).exists()
    assert [p.name for p in (tmp_path / "out").iterdir()] == [PARTIAL_PREFIX + leader.ckid]


def test_a_fetch_says_hello_again_when_its_source_forgets_it(leader, tmp_path):
    """A holder keeps the pair keys of its last `max_senders` senders: others' hellos between
    two chunk requests made it forget the fetching client, whose next request was refused
    (401, "say hello first") and the only source dropped -- "is this the right swarm key?".
    Now the fetch says hello again and asks once more."""
    leader.auth = ServerAuth(KEY, Life(leader.ident), max_senders=2)
    others = [Signer(KEY, Life.throwaway(1)) for _ in range(2)]
    app = make_app(leader)

    @web.middleware
    async def crowd(request, handler):
        if request.path.endswith("safetensors") and leader.counts["chunks"] == 2:
            for other in others:  # two other senders say hello meanwhile
                introduce(other, leader.auth)
        return await handler(request)

    app.middlewares.append(crowd)
    got = fetch(leader, tmp_path / "out", app=app)
    assert got == tmp_path / "out" / leader.ckid
    assert store.read_manifest(got) == store.read_manifest(leader.ckroot / leader.ckid)
    assert leader.counts["chunks"] > 6  # the 6 chunks, one of them asked for again


def test_a_fetch_goes_on_under_the_nodes_new_life(leader, tmp_path):
    """A joiner that switches to outbound-only mid-fetch goes on under a new incarnation, and
    its outbox says hello under it at once: the source then refuses the old life ("say hello
    first") and refused its re-hello as older, so the fetch failed. Given the node's signer of
    the moment, the fetch says hello again under the new life and goes on."""
    node_key = Ed25519PrivateKey.generate()
    node = {"signer": Signer(KEY, Life.throwaway(5, node_key))}
    new = Signer(KEY, Life.throwaway(6, node_key))
    app = make_app(leader)

    @web.middleware
    async def switch(request, handler):
        if request.path.endswith("safetensors") and leader.counts["chunks"] == 2:
            introduce(new, leader.auth)  # the node's outbox, under its new life
            node["signer"] = new
        return await handler(request)

    app.middlewares.append(switch)

    async def run() -> Path:
        async with serving(app) as base, aiohttp.ClientSession() as session:
            fetched = await fetch_checkpoint(session, [base.removeprefix("http://")],
                                             lambda: node["signer"], tmp_path / "out",
                                             expected_leader=leader.ident.node_id)
            return fetched.path

    assert asyncio.run(run()) == tmp_path / "out" / leader.ckid


def test_a_fetch_waits_for_a_source_busy_with_hellos(leader, tmp_path):
    """A source answers 429 to hellos past its budget for our address: the fetch asks again a
    second later instead of dropping its only source."""
    asked = []

    def allow(addr: str) -> bool:
        asked.append(addr)
        return len(asked) > 2  # the first two: later

    got = fetch(leader, tmp_path / "out", app=make_app(leader, allow=allow))
    assert got == tmp_path / "out" / leader.ckid and len(asked) == 3


def test_a_response_with_a_bad_mac_is_refused(leader, tmp_path):
    class Forger(ServerAuth):  # accepts our requests, signs answers with another key
        def sign(self, method, path, rid, status, body):
            return response_headers(OTHER_KEY, method, path, rid, status, body)

    leader.auth = Forger(KEY, Life(leader.ident))
    with pytest.raises(FetchError, match="response MAC does not verify"):
        fetch(leader, tmp_path / "out")


def test_a_checkpoint_signed_by_someone_else_than_the_leader_is_refused(leader, tmp_path):
    with pytest.raises(FetchError, match=f"signed by {leader.ident.node_id}, not the leader "
                                         f"{'ab' * 16}"):
        fetch(leader, tmp_path / "out", expected="ab" * 16)
    assert leader.counts["chunks"] == 0


def forged_app(lead: Leader, body: bytes) -> web.Application:
    """A server answering GET /v1/checkpoint with `body`, correctly MACed."""
    async def answer(request: web.Request) -> web.Response:
        rid = lead.auth.verify(request.method, request.path, request.headers, b"")
        return web.Response(body=body, headers=lead.auth.sign("GET", request.path, rid, 200,
                                                               body))
    app = web.Application()
    add_hello_route(app, lead.auth)
    app.router.add_get("/v1/checkpoint", answer)
    return app


def test_a_manifest_naming_a_leader_whose_key_did_not_sign_it_is_refused(leader, tmp_path):
    manifest = store.read_manifest(leader.ckroot / leader.ckid).to_json()
    manifest["leader"] = "ab" * 16  # claims another leader, signed by our key
    manifest["signature"] = leader.ident.sign(mf.canonical_bytes(manifest)).hex()
    body = json.dumps({"id": leader.ckid, "manifest": manifest}).encode()
    with pytest.raises(FetchError, match="signed by another key"):
        fetch(leader, tmp_path / "out", expected=None, app=forged_app(leader, body))


@pytest.mark.parametrize("body,reason", [
    (b"not json", "not JSON"), (b"[" * 100_000 + b"]" * 100_000, "not JSON"),
    (b'{"id": 1}', "not an {id, manifest, have} object"), (b"[]", "not an {id, manifest"),
    (b" " * (12 * 2**20), "too long"),
])
def test_a_hostile_checkpoint_answer_is_refused(leader, tmp_path, body, reason):
    with pytest.raises(FetchError, match=reason):
        fetch(leader, tmp_path / "out", app=forged_app(leader, body))
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_rewritten_under_the_same_id_replaces_the_fetched_one(leader, tmp_path):
    first = fetch(leader, tmp_path / "out")
    save_checkpoint(leader.ckroot, leader.ident, seed=1)  # same (term, step), new weights
    again = fetch(leader, tmp_path / "out")
    assert again == first and leader.counts["chunks"] == 12
    want = load_file(str(leader.ckroot / leader.ckid / store.MODEL_FILE))["w"]
    np.testing.assert_array_equal(load_file(str(again / store.MODEL_FILE))["w"], want)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [leader.ckid]


def test_a_checkpoint_set_aside_by_a_killed_fetch_is_removed_once_the_join_is_over(leader,
                                                                                    tmp_path):
    """finish() renames the old copy to `.old-<id>-<pid>` before the new one takes its name;
    a SIGKILL between the two renames and the rmtree left it (a whole checkpoint) for good."""
    import os
    import subprocess

    from p2ptrain.net.joinflow import clean_fetched
    from p2ptrain.net.partial import OLD_PREFIX

    out = tmp_path / "out"
    first = fetch(leader, out)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    orphan = out / f"{OLD_PREFIX}{leader.ckid}-{dead.pid}"
    live = out / f"{OLD_PREFIX}{leader.ckid}-{os.getpid()}"  # a fetch under way
    for aside in (orphan, live):
        aside.mkdir()
        (aside / store.MODEL_FILE).write_bytes(b"x" * 1000)
    (out / f"{PARTIAL_PREFIX}x").mkdir()
    clean_fetched(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([first.name, live.name])


@pytest.mark.parametrize("damage,reason", [
    (lambda m: m.update(step=True), "not a count"),
    (lambda m: m.update(step=8), "signature does not verify"),
    (lambda m: m.update(extra=1), "unexpected"),
    (lambda m: m.pop("arch"), "missing"),
    (lambda m: m["files"][store.MODEL_FILE]["xxh3_64"].pop(), "chunk list does not match"),
    (lambda m: m["files"][store.MODEL_FILE].update(size=2**60), "impossible size"),
    (lambda m: m["files"][store.STATE_FILE].update(chunk_size=2**30), "outside"),
    (lambda m: m["files"][store.STATE_FILE]["xxh3_64"].__setitem__(0, "x" * 16), "chunk hash"),
    (lambda m: m["files"].pop(store.STATE_FILE), "must list exactly"),
    (lambda m: m["swarm_count"].update(x=1), "not the sum"),
    (lambda m: m["files"][store.STATE_FILE].update(size=0), "impossible size"),
    (lambda m: m.update(leader_key="0G" * 32), "malformed"),
    (lambda m: m.update(leader_key="00" * 32), "signature does not verify"),
    (lambda m: m.update(signature="00" * 64), "signature does not verify"),
])
def test_malformed_or_tampered_manifests_are_refused(leader, damage, reason):
    manifest = store.read_manifest(leader.ckroot / leader.ckid).to_json()
    ckid, parsed, have = check_answer({"id": leader.ckid, "manifest": manifest})
    assert (ckid, parsed.to_json(), have) == (leader.ckid, manifest, None)
    damage(manifest)
    with pytest.raises(FetchError, match=reason):
        check_answer({"id": leader.ckid, "manifest": manifest})


def test_an_id_that_does_not_name_the_manifest_is_refused(leader):
    manifest = store.read_manifest(leader.ckroot / leader.ckid).to_json()
    with pytest.raises(FetchError, match="does not name the manifest's term and step"):
        check_answer({"id": "ckpt-t000002-s0000000008", "manifest": manifest})


def test_an_interrupted_fetch_resumes_with_only_the_missing_chunks(leader, tmp_path):
    leader.cut_after = 3
    with pytest.raises(FetchError, match="closed the connection|cut short|attempts"):
        fetch(leader, tmp_path / "out", chunk_retries=1)
    partial = tmp_path / "out" / (PARTIAL_PREFIX + leader.ckid)
    done = json.loads((partial / "progress.json").read_text())["done"]
    kept = sum(len(v) for v in done.values())  # 3, or 2 when the cut ends the fetch while the
    # third chunk is still in flight (a loaded machine)
    assert 2 <= kept <= 3 and not (tmp_path / "out" / leader.ckid).exists()
    leader.cut_after, leader.counts["chunks"] = None, 0
    out = fetch(leader, tmp_path / "out")
    assert leader.counts["chunks"] == 6 - kept
    assert store.read_manifest(out).leader == leader.ident.node_id and not partial.exists()


def test_a_fetch_stopped_inside_its_final_rename_resumes_without_fetching_again(leader,
                                                                              tmp_path):
    """finish() writes the manifest, drops the progress record, then renames: a crash
    between the two lost the record, and the next fetch threw the whole partial away."""
    out = fetch(leader, tmp_path / "out")
    partial = tmp_path / "out" / (PARTIAL_PREFIX + leader.ckid)
    out.rename(partial)  # as finish() left it just before its rename
    assert not (partial / "progress.json").exists()
    leader.counts["chunks"] = 0
    again = fetch(leader, tmp_path / "out")
    assert leader.counts["chunks"] == 0 and store.read_manifest(again).step == \
        store.read_manifest(leader.ckroot / leader.ckid).step and not partial.exists()


def test_a_resumed_chunk_that_no_longer_hashes_right_is_fetched_again(leader, tmp_path):
    leader.cut_after = 3
    with pytest.raises(FetchError):
        fetch(leader, tmp_path / "out", chunk_retries=0)
    partial = tmp_path / "out" / (PARTIAL_PREFIX + leader.ckid)
    done = json.loads((partial / "progress.json").read_text())["done"]
    name = next(n for n in done if done[n])  # a file with a chunk listed as done
    with open(partial / name, "r+b") as f:  # a crash lost part of a chunk listed as done
        f.seek(done[name][0] * CHUNK)
        f.write(b"\0" * 16)
    kept = sum(len(v) for v in done.values())  # (3, or 2: the test above)
    leader.cut_after, leader.counts["chunks"] = None, 0
    fetch(leader, tmp_path / "out")
    assert kept >= 2 and leader.counts["chunks"] == 6 - kept + 1


def test_path_traversal_unknown_files_and_bad_ids_get_404(leader):
    ckid, model = leader.ckid, store.MODEL_FILE
    ours = [f"/v1/checkpoint/..%2F..%2Fidentity.key/{model}",
            f"/v1/checkpoint/{ckid}/..%2F..%2F..%2Fidentity.key",
            f"/v1/checkpoint/%2e%2e/{model}",
            f"/v1/checkpoint/{ckid}/..",
            f"/v1/checkpoint/{ckid}/identity.key",
            f"/v1/checkpoint/{ckid}/progress.json",
            f"/v1/checkpoint/ckpt-t1-s1/{model}",
            f"/v1/checkpoint/{ckid}%0A/{model}",
            f"/v1/checkpoint/{quote(ckid.replace('0', ARABIC_ZERO))}/{model}",
            f"/v1/checkpoint/ckpt-t000002-s0000000099/{model}"]

    async def run():
        async with serving(make_app(leader)) as base, aiohttp.ClientSession() as session:
            signer = Signer(KEY, Life.throwaway(1, CLIENT_KEY))
            for path in ours:
                status, headers, body, rid = await raw_get(session, base, path, signer)
                assert status == 404, path
                signer.check_response("GET", URL(base + path, encoded=True).path, rid, 404,
                                      headers, body)
            status, *_ = await raw_get(session, base, "/v1/checkpoint/../../etc/passwd", signer)
            assert status == 404
    asyncio.run(run())


def test_ranges_whole_files_and_unsatisfiable_ranges(leader):
    path = f"/v1/checkpoint/{leader.ckid}/{store.MODEL_FILE}"
    data = (leader.ckroot / leader.ckid / store.MODEL_FILE).read_bytes()

    async def run():
        async with serving(make_app(leader)) as base, aiohttp.ClientSession() as session:
            signer = Signer(KEY, Life.throwaway(1, CLIENT_KEY))
            for rng, status, want in [
                (None, 200, data), ("bytes=10-19", 206, data[10:20]),
                (f"bytes={len(data) - 5}-", 206, data[-5:]),
                (f"bytes={len(data)}-{len(data) + 10}", 416, None),
                ("bytes=-5", 416, None), ("bytes=0-1,4-5", 416, None), ("items=0-1", 416, None),
            ]:
                got, headers, body, rid = await raw_get(session, base, path, signer,
                                                        {"Range": rng} if rng else None)
                assert got == status, rng
                signer.check_response("GET", path, rid, status, headers, body)
                if want is not None:
                    assert body == want
                if status == 416:
                    assert headers["Content-Range"] == f"bytes */{len(data)}"
    asyncio.run(run())


@pytest.mark.parametrize("header,size,want", [
    ("bytes=0-9", 100, (0, 9)), ("bytes=90-200", 100, (90, 99)), ("bytes=5-", 100, (5, 99)),
    (" bytes = 1-2 ", 100, (1, 2)), ("bytes=0-", 10**12, (0, ckptserve.MAX_RANGE - 1)),
    ("bytes=100-", 100, None), ("bytes=9-3", 100, None), ("bytes=-3", 100, None),
    ("bytes=1-2,3-4", 100, None), ("bytes=0x1-2", 100, None), ("bytes=" + "9" * 30 + "-", 100,
                                                                None),
    ("bytes=\u0661-2", 100, None), ("", 100, None), ("bytes=0-0", 0, None),
])
def test_parse_range(header, size, want):
    if want is None:
        with pytest.raises(RangeError):
            parse_range(header, size)
    else:
        assert parse_range(header, size) == want


def test_a_holder_serves_what_it_holds_and_the_fetcher_wants_the_leaders(leader, tmp_path):
    other = load_or_create(tmp_path / "other")
    save_checkpoint(leader.ckroot, other, step=9)  # newer, signed by another node
    assert Shelf(lambda: [leader.ckroot]).latest().id == "ckpt-t000002-s0000000009"
    with pytest.raises(FetchError, match=f"signed by {other.node_id}, not the leader"):
        fetch(leader, tmp_path / "out")
    assert fetch(leader, tmp_path / "out2", expected=other.node_id).name == \
        "ckpt-t000002-s0000000009"
    leader.ckroot = tmp_path / "empty"
    with pytest.raises(FetchError, match="no checkpoint"):
        fetch(leader, tmp_path / "out")


def test_verification_is_cached_until_the_manifest_changes(leader, monkeypatch):
    calls = []
    real = mf.verify
    monkeypatch.setattr(mf, "verify", lambda p, *a: calls.append(p.name) or real(p, *a))
    shelf = Shelf(lambda: [leader.ckroot])
    for _ in range(3):
        assert shelf.latest().id == leader.ckid
    assert calls == [leader.ckid]
    save_checkpoint(leader.ckroot, leader.ident, seed=1)  # the same (term, step) rewritten
    assert shelf.latest().id == leader.ckid
    assert calls == [leader.ckid, leader.ckid]


def test_a_checkpoint_of_another_model_is_refused_before_a_byte_of_it_is_fetched(leader,
                                                                                   tmp_path):
    """The joiner compared the fingerprint after fetching the whole checkpoint -- as much as
    a manifest may declare -- then kept it in fetched/ and served it to others."""
    from p2ptrain.net.fetch import NoCheckpoint, fetch_checkpoint

    async def run(fingerprint):
        async with serving(make_app(leader)) as base, aiohttp.ClientSession() as session:
            return await fetch_checkpoint(
                session, [base.removeprefix("http://")], Signer(KEY, Life.throwaway(
                    next(INCARNATIONS), CLIENT_KEY)),
                tmp_path / "out", expected_leader=leader.ident.node_id,
                fingerprint=fingerprint)

    with pytest.raises(NoCheckpoint, match="another model"):
        asyncio.run(run("another"))
    assert leader.counts["chunks"] == 0
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    assert asyncio.run(run("fp")).path.is_dir()  # its own model's: fetched as before
    assert leader.counts["chunks"] > 0
