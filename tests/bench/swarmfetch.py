"""Checkpoints from many holders across network namespaces (issue 14), as a benchmark and as
the pieces of its netns test.

    python -m tests.bench.swarmfetch --size-mb 48 --rate-mbit 40 [--chunk-kib 512]

builds a lab of four hosts (namespaces on one bridge): three holders, each serving a copy of
one checkpoint with its egress shaped by `tc tbf` to the same rate R, and a fetcher with an
unshaped link. It times a fetch from the leader alone, then from all three at once (each into
an empty directory), and prints the rates, their ratio to R and to 3R, and each holder's share
of the chunks. Goal: from many >= 0.8 x 3R; leader alone ~ R.

Subcommands used inside the namespaces (also by tests/test_ckptswarm_netns.py):

    python -m tests.bench.swarmfetch serve --root DIR --port P --key HEX
    python -m tests.bench.swarmfetch fetch --out DIR --key HEX --leader ID ADDR [ADDR ...]

`serve` prints `ready` once listening and serves until SIGTERM; `fetch` prints one JSON line:
seconds, bytes, chunks served per source, sources dropped and why, the checkpoint directory.
This driver reads the clock; the test asserts on shares and bytes only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

from p2ptrain.checkpoint import store
from p2ptrain.identity import load_or_create
from p2ptrain.net.auth import ServerAuth, Signer, derive_mac_key
from p2ptrain.net.ckptserve import Serving, add_checkpoint_routes
from p2ptrain.net.fetch import fetch_checkpoint
from p2ptrain.net.hello import add_hello_route
from p2ptrain.net.session import Life
from p2ptrain.net.shelf import Shelf

PORT = 7600
REPO = Path(__file__).resolve().parents[2]  # the processes import tests.bench from here


def make_checkpoint(root: Path, size_mb: float, chunk: int, seed: int = 0) -> Path:
    """A signed checkpoint of about `size_mb` MB of float32 weights, `chunk`-byte chunks."""
    ident = load_or_create(root.parent / "leader-identity")
    n = int(size_mb * 1e6 / 4)
    rng = np.random.default_rng(seed)
    snap = store.Snapshot(step=100, term=5, swarm_count={ident.node_id: 1000}, fingerprint="fp",
                          arch={"model": "bench"},
                          model_tensors=[("w", rng.standard_normal(n, dtype=np.float32))],
                          state_tensors=[("adam.m", np.zeros(16, np.float32))],
                          state_meta={"step": 100})
    saved, store.CHUNK_SIZE = store.CHUNK_SIZE, chunk
    try:
        return store.save(root, snap, ident, keep=1)
    finally:
        store.CHUNK_SIZE = saved


async def serve(root: Path, port: int, key: bytes) -> None:
    app = web.Application()
    auth = ServerAuth(key, Life.throwaway(1))
    add_hello_route(app, auth)
    add_checkpoint_routes(app, Serving(Shelf(lambda: [root]), auth))
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    print("ready", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await runner.cleanup()


async def fetch(sources: list[str], out: Path, key: bytes, leader: str) -> dict:
    signer = Signer(key, Life.throwaway(1))
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        got = await fetch_checkpoint(session, sources, signer, out, expected_leader=leader,
                                     files=(store.MODEL_FILE,))
        seconds = time.monotonic() - t0
    return {"seconds": seconds, "bytes": got.manifest.size((store.MODEL_FILE,)),
            "served": got.served, "dropped": got.dropped, "path": str(got.path),
            "chunks": len(got.manifest.chunks((store.MODEL_FILE,)))}


class Lab:
    """Holders 0..2 and a fetcher (host 3) in a NetLab; see the module docstring."""

    def __init__(self, net, work: Path, size_mb: float, rate_mbit: float, chunk: int):
        self.net, self.work = net, work
        self.key = secrets.token_bytes(32)
        self.path = make_checkpoint(work / "lead", size_mb, chunk)
        self.manifest = store.read_manifest(self.path)
        self.holders = []
        for i in range(3):
            root = work / f"h{i}"
            root.mkdir()
            shutil.copytree(self.path, root / self.path.name)
            net.run(i, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                        f"{rate_mbit}mbit", "burst", "32kb", "latency", "400ms"])
            proc = net.popen(i, [sys.executable, "-m", "tests.bench.swarmfetch", "serve",
                                 "--root", str(root), "--port", str(PORT),
                                 "--key", derive_mac_key(self.key).hex()],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
            self.holders.append(proc)
        for proc in self.holders:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a holder did not start")
        self.addrs = [f"{net.addr(i)}:{PORT}" for i in range(3)]

    def fetch(self, sources: list[str], out: Path, timeout: float = 300) -> dict:
        done = self.net.run(3, [sys.executable, "-m", "tests.bench.swarmfetch", "fetch",
                                "--out", str(out), "--key", derive_mac_key(self.key).hex(),
                                "--leader", self.manifest.leader, *sources], timeout=timeout,
                           cwd=REPO)
        return json.loads(done.stdout.strip().splitlines()[-1])


def benchmark(size_mb: float, rate_mbit: float, chunk: int) -> None:
    from tests.netlab import NetLab

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # cleanup runs on SIGTERM too
    with tempfile.TemporaryDirectory() as tmp, NetLab(4, prefix="ckfs") as net:
        lab = Lab(net, Path(tmp), size_mb, rate_mbit, chunk)
        rate = rate_mbit * 1e6 / 8
        alone = lab.fetch(lab.addrs[:1], Path(tmp) / "out-alone")
        many = lab.fetch(lab.addrs, Path(tmp) / "out-many")
        for name, r in (("leader alone", alone), ("from 3 holders", many)):
            mbs = r["bytes"] / r["seconds"] / 1e6
            shares = [round(r["served"].get(a, 0) / r["chunks"], 2) for a in lab.addrs]
            print(f"{name:15s} {r['bytes'] / 1e6:6.1f} MB in {r['seconds']:6.2f} s = "
                  f"{mbs:6.2f} MB/s = {mbs * 1e6 / rate:4.2f} R = {mbs * 1e6 / (3 * rate):4.2f}"
                  f" x 3R; chunk shares {shares}")
        print(f"R = {rate_mbit} Mbit/s = {rate / 1e6:.2f} MB/s per holder; {many['chunks']} "
              f"chunks of {chunk // 1024} KiB; from-many / leader-alone = "
              f"{alone['seconds'] / many['seconds']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd")
    s = sub.add_parser("serve")
    s.add_argument("--root", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--key", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("--out", required=True)
    f.add_argument("--key", required=True)
    f.add_argument("--leader", required=True)
    f.add_argument("sources", nargs="+")
    p.add_argument("--size-mb", type=float, default=48)
    p.add_argument("--rate-mbit", type=float, default=40)
    p.add_argument("--chunk-kib", type=int, default=512)
    args = p.parse_args()
    if args.cmd == "serve":
        asyncio.run(serve(Path(args.root), args.port, bytes.fromhex(args.key)))
    elif args.cmd == "fetch":
        print(json.dumps(asyncio.run(fetch(args.sources, Path(args.out),
                                           bytes.fromhex(args.key), args.leader))))
    else:
        benchmark(args.size_mb, args.rate_mbit, args.chunk_kib * 1024)


if __name__ == "__main__":
    main()
