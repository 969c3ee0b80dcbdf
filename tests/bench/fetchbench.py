"""`python -m tests.bench.fetchbench --size-mb 256`: checkpoint fetch throughput against a
plain aiohttp download of the same weight file, over loopback, in one process.

A fresh identity saves a checkpoint of random float32 weights (about `--size-mb` MiB, with a
tiny state file) into a temporary directory. One aiohttp server on 127.0.0.1 serves it through
`add_checkpoint_routes` and serves model.safetensors again through a plain static route
(`web.FileResponse`). Each repeat times `fetch_latest` into an empty directory (signed Range
requests per chunk, MAC and hash checks as chunks arrive, fsync) and a plain streamed GET
of model.safetensors read in 1 MiB pieces into a file that is then fsynced, so both sides pay
for durable bytes. Figures are medians; MB/s counts 10^6 bytes of the files written. Client
and server share one event loop, as they would not in a real swarm: treat the ratio, not the
absolute figures, as the result. This driver is the only file here that reads the clock.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from p2ptrain.checkpoint import Snapshot, store
from p2ptrain.identity import load_or_create
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.ckptserve import Serving, add_checkpoint_routes
from p2ptrain.net.fetch import fetch_latest
from p2ptrain.net.hello import add_hello_route
from p2ptrain.net.session import Life
from p2ptrain.net.shelf import Shelf

PIECE = 2**20  # bytes per read of the plain download


def make_checkpoint(root: Path, size_mb: int, seed: int = 0):
    """A fresh identity and a checkpoint of about `size_mb` MiB of random weights it signed."""
    ident = load_or_create(root / "leader")
    weights = np.random.default_rng(seed).standard_normal(size_mb * 2**18, dtype=np.float32)
    snap = Snapshot(step=1, term=1, swarm_count={ident.node_id: 1}, fingerprint="bench",
                    arch={"model": "bench"}, model_tensors=[("w", weights)],
                    state_tensors=[("m", np.zeros(1024, np.float32))], state_meta={})
    return ident, store.save(root / "checkpoints", snap, ident, keep=1)


async def plain_download(session: aiohttp.ClientSession, url: str, dest: Path) -> int:
    """Stream `url` into `dest` in 1 MiB pieces, fsync it; the bytes written."""
    written = 0
    async with session.get(url) as resp:
        resp.raise_for_status()
        with open(dest, "wb") as f:
            async for piece in resp.content.iter_chunked(PIECE):
                f.write(piece)
                written += len(piece)
            f.flush()
            os.fsync(f.fileno())
    return written


async def run_bench(size_mb: int, repeats: int) -> dict:
    """Median fetch and plain-download throughput for a checkpoint of `size_mb` MiB."""
    with tempfile.TemporaryDirectory(prefix="fetchbench-") as tmp:
        root = Path(tmp)
        ident, ckpt = make_checkpoint(root, size_mb)
        key = derive_mac_key(os.urandom(32))
        app = web.Application()
        auth = ServerAuth(key, Life(ident))
        add_hello_route(app, auth)
        shelf = Shelf(lambda: [ckpt.parent])
        add_checkpoint_routes(app, Serving(shelf, auth))

        async def plain(request: web.Request) -> web.FileResponse:
            return web.FileResponse(ckpt / store.MODEL_FILE)

        app.router.add_get("/plain/model", plain)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await asyncio.to_thread(shelf.latest)  # hash it once
        fetched = sum((ckpt / n).stat().st_size for n in (store.MODEL_FILE, store.STATE_FILE))
        fetch_s, plain_s, plain_bytes = [], [], 0
        try:
            async with aiohttp.ClientSession() as session:
                signer = Signer(key, Life(load_or_create(root / "client")))
                for i in range(repeats):
                    out = root / f"fetch-{i}"
                    start = time.perf_counter()
                    await fetch_latest(session, base, signer, out, expected_leader=ident.node_id)
                    fetch_s.append(time.perf_counter() - start)
                    shutil.rmtree(out)
                    start = time.perf_counter()
                    plain_bytes = await plain_download(session, base + "/plain/model",
                                                       root / "plain.bin")
                    plain_s.append(time.perf_counter() - start)
                    (root / "plain.bin").unlink()
        finally:
            await runner.cleanup()
    fetch_mbs = fetched / 1e6 / statistics.median(fetch_s)
    plain_mbs = plain_bytes / 1e6 / statistics.median(plain_s)
    return {"size_mb": size_mb, "repeats": repeats, "fetch_bytes": fetched,
            "plain_bytes": plain_bytes, "fetch_MBps": round(fetch_mbs, 1),
            "plain_MBps": round(plain_mbs, 1), "ratio": round(fetch_mbs / plain_mbs, 3)}


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the benchmark, print the figures."""
    parser = argparse.ArgumentParser(prog="python -m tests.bench.fetchbench")
    parser.add_argument("--size-mb", type=int, default=256, help="weights, MiB (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.size_mb < 1 or args.repeats < 1:
        parser.error("--size-mb and --repeats must be at least 1")
    result = asyncio.run(run_bench(args.size_mb, args.repeats))
    if args.json:
        print(json.dumps(result))
        return
    print(f"checkpoint fetch : {result['fetch_MBps']:8.1f} MB/s  ({result['fetch_bytes']} B)")
    print(f"plain download   : {result['plain_MBps']:8.1f} MB/s  ({result['plain_bytes']} B)")
    print(f"ratio fetch/plain: {result['ratio']:8.3f}  (median of {result['repeats']})")


if __name__ == "__main__":
    main()
