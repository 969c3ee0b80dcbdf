"""Fetching a LoRA swarm's frozen base from every member that serves it, checked against an
id known in advance.

    fetch_base(session, [addr, ...], signer, base_id, out_root, progress) -> Base

1. Hello every source (hello.py), ask one after another for `GET /v1/base/{id}` until a
   manifest whose SHA-256 is the id arrives (a source answering another is dropped, named).
   The manifest is parsed strictly (lora/basefile.py) before anything is sized from it.
2. Chunks from all sources at once: IN_FLIGHT requests per source, MAX_IN_FLIGHT in all (a
   chunk in flight is held in memory), each source taking the next chunk as soon as one of
   its requests ends (fast links take more). Each answer's MAC, Content-Range and xxh3_64
   are checked before the chunk is written in place.
3. A transport error, 5xx or bad MAC puts the chunk back and rests the source; a request
   slow where another source could do far better is taken back (fetch.py's rule, step 4;
   not a failure); SOURCE_FAILURES
   in a row drop it. A source serving bytes that do not match is dropped at once. No source
   left, or a chunk that failed RETRIES times, ends the fetch with every source's story.
4. The file is written into out_root/.partial-base-<id>/, fsynced with the manifest, and
   renamed to out_root/<id>: a base directory appears whole or not at all. A fetch that
   breaks off leaves the partial file; the next one hashes its chunks again and fetches only
   the missing or wrong ones.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import aiohttp
import xxhash

from p2ptrain.fsutil import atomic_write_bytes, describe_os_error, fsync_dir
from p2ptrain.lora.basefile import (
    BASE_FILE,
    MANIFEST,
    Base,
    BaseError,
    intact,
    parse_manifest,
    read_base,
)
from p2ptrain.lora.basefile import base_id as id_of
from p2ptrain.net.auth import Signer
from p2ptrain.net.fetch import (
    BACKOFF,
    BACKOFF_MAX,
    IN_FLIGHT,
    MAX_IN_FLIGHT,
    MAX_SOURCES,
    REFRESH,
    SOURCE_FAILURES,
    FetchError,
    Source,
    _check_mac,
    _connect,
    _Drop,
    _get,
    _printable,
    _reason,
    _Retry,
    measured,
    preempt_reason,
)
from p2ptrain.net.partial import PARTIAL_PREFIX, write_chunk

MAX_MANIFEST = 8 * 2**20 + 1024
RETRIES = 8  # attempts of one chunk before the fetch gives up


async def _manifest(sources: list[Source], base_id: str) -> bytes:
    """The manifest bytes of `base_id` from the first source that has it right."""
    for src in sources:
        if src.conn is None:
            continue
        try:
            answer = await _get(src.conn, f"/v1/base/{base_id}", 200, MAX_MANIFEST, None,
                                timeout=src.conn.answer_timeout)  # whole: not trickled
            _check_mac(src.conn.signer, answer)
        except (_Retry, _Drop) as exc:
            src.dropped = _printable(str(exc), 300)
            continue
        if answer.status != 200:
            src.dropped = f"has no base {base_id} ({_reason(answer.body)})"
            continue
        data = bytes(answer.body)
        try:
            doc = parse_manifest(data)
        except BaseError as exc:
            src.dropped = f"served a bad manifest: {exc}"
            continue
        if id_of(doc) != base_id:
            src.dropped = f"served the manifest of another base ({id_of(doc)})"
            continue
        return data
    raise FetchError(f"no source serves base {base_id}: " + "; ".join(
        f"{s.addr}: {s.dropped}" for s in sources if s.dropped))


async def fetch_base(session: aiohttp.ClientSession, addrs: list[str], signer: Signer,
                     base_id: str, out_root: Path, timeout: float = 30.0,
                     progress: Callable[[int, int, int], None] | None = None) -> Base:
    """Fetch base `base_id` from the nodes at `addrs` (MAX_SOURCES of them at most: the list
    comes from a status document anything may have written) into out_root/<id> (see the
    module docstring); FetchError says why not, a full disk too."""
    sources = [Source(a) for a in list(dict.fromkeys(addrs))[:MAX_SOURCES]]
    await asyncio.gather(*(_connect(session, s, signer, timeout) for s in sources))
    try:
        return await _fetch(sources, base_id, out_root, progress)
    except OSError as exc:
        raise FetchError(f"base {base_id} into {out_root}: {describe_os_error(exc)}") from None


async def _fetch(sources: list[Source], base_id: str, out_root: Path,
                 progress: Callable[[int, int, int], None] | None) -> Base:
    data = await _manifest(sources, base_id)
    doc = parse_manifest(data)
    size, chunk = doc["file"]["size"], doc["file"]["chunk_size"]
    hashes = doc["file"]["xxh3_64"]
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f"{PARTIAL_PREFIX}base-{base_id}"  # kept when a fetch breaks off
    target = tmp / BASE_FILE
    try:
        there = target.stat().st_blocks * 512  # what a broken-off fetch wrote already
    except OSError:
        there = 0
    free = shutil.disk_usage(out_root).free
    if free + there < size:
        raise FetchError(f"base {base_id} is {size / 1e9:.2f} GB, {out_root} has "
                         f"{free / 1e9:.2f} GB free")
    tmp.mkdir(exist_ok=True)
    have = await asyncio.to_thread(_resume, target, size, chunk, hashes)
    if not have:
        with open(target, "wb") as f:
            f.truncate(size)
    await _chunks(sources, base_id, target, size, chunk, hashes, progress, have)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())
    atomic_write_bytes(tmp / MANIFEST, data)
    fsync_dir(tmp)
    final = out_root / base_id
    if intact(final):
        shutil.rmtree(tmp)
    else:  # none there, or one damaged since: this one takes its place
        aside = out_root / f"{PARTIAL_PREFIX}damaged-{base_id}"
        shutil.rmtree(aside, ignore_errors=True)
        if final.exists():
            os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(out_root)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        base = read_base(final)
    except BaseError as exc:
        raise FetchError(str(exc)) from None
    if base.id != base_id:  # a directory of that name was there already, and differs
        raise FetchError(f"{final} does not hold base {base_id}")
    return base


def _resume(target: Path, size: int, chunk: int, hashes: list[str]) -> set[int]:
    """The chunks of an earlier, broken-off fetch that are there and right (hashed again:
    a crash may have lost what was not synced); none when there is no such file."""
    try:
        if target.stat().st_size != size:
            return set()
        have = set()
        with open(target, "rb") as f:
            for i, digest in enumerate(hashes):
                if xxhash.xxh3_64_hexdigest(f.read(chunk)) == digest:
                    have.add(i)
        return have
    except OSError:
        return set()


async def _chunks(sources: list[Source], base_id: str, target: Path, size: int, chunk: int,
                  hashes: list[str], progress, have: set[int]) -> None:
    todo: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(hashes)):
        if i not in have:
            todo.put_nowait(i)
    tries = [0] * len(hashes)
    done = [len(have)]
    slots = asyncio.Semaphore(MAX_IN_FLIGHT)
    failed: list[str] = []
    path = f"/v1/base/{base_id}/{BASE_FILE}"

    async def one(src: Source, i: int) -> None:
        first = i * chunk
        last = min(size, first + chunk) - 1
        buf = bytearray(last - first + 1)
        answer = await _get(src.conn, path, 206, len(buf), buf, (first, last))
        _check_mac(src.conn.signer, answer)
        if answer.status >= 500:
            raise _Retry(f"server error {answer.status} ({_reason(answer.body)})")
        if answer.status != 206:
            raise _Drop(f"answer {answer.status} to a range ({_reason(answer.body)})")
        if answer.headers.get("Content-Range") != f"bytes {first}-{last}/{size}" \
                or len(answer.body) != last - first + 1:
            raise _Drop("served range does not match the manifest")
        body = answer.body
        if await asyncio.to_thread(xxhash.xxh3_64_hexdigest, body) != hashes[i]:
            raise _Drop(f"served chunk {i} of base {base_id} with bytes that do not match "
                        f"its manifest")
        await asyncio.to_thread(write_chunk, target, first, body)

    busy: dict[Source, int] = {}  # requests in flight per source

    async def timed(src: Source, i: int) -> str:
        """`one`, taken back (its reason returned) when `preempt` says so: a source trickling
        bytes never times out, and the chunk it holds would hold up the end of the fetch."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        length = min(size, (i + 1) * chunk) - i * chunk
        task = asyncio.ensure_future(one(src, i))
        busy[src] = busy.get(src, 0) + 1
        try:
            while not (await asyncio.wait({task}, timeout=REFRESH))[0]:
                elapsed = loop.time() - started
                live = [s for s in sources if s.conn is not None and not s.dropped]
                if why := preempt_reason(src, live, {s for s, n in busy.items() if n},
                                         length, elapsed):
                    measured(src, length / elapsed)  # an upper bound
                    return why
            task.result()  # its failure, if any
        finally:
            busy[src] -= 1
            task.cancel()
        measured(src, length / max(loop.time() - started, 1e-6))
        return ""

    async def worker(src: Source) -> None:
        while not src.dropped and not failed:
            try:
                i = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            async with slots:
                try:
                    if await timed(src, i):  # taken back: not a failure of the source;
                        todo.put_nowait(i)  # its worker ends, and the next round's workers
                        return  # start fastest source first (they take the chunks first)
                except (_Retry, _Drop) as exc:
                    todo.put_nowait(i)
                    tries[i] += 1
                    if tries[i] >= RETRIES:
                        failed.append(f"chunk {i} failed {RETRIES} times")
                    if isinstance(exc, _Drop):
                        src.dropped = _printable(str(exc), 300)
                        return
                    src.failures += 1
                    if src.failures >= SOURCE_FAILURES:
                        src.dropped = (f"failed {src.failures} times in a row, last: "
                                       f"{_printable(str(exc))}")
                        return
                    await asyncio.sleep(min(BACKOFF_MAX, BACKOFF * 2 ** (src.failures - 1)))
                    continue
            src.failures = 0
            src.chunks += 1
            done[0] += 1
            if progress is not None:
                progress(min(size, done[0] * chunk), size, sum(
                    1 for s in sources if not s.dropped))

    live = [s for s in sources if s.conn is not None and not s.dropped]
    while todo.qsize() and live and not failed:
        live.sort(key=lambda s: -s.rate)
        await asyncio.gather(*(worker(s) for s in live for _ in range(IN_FLIGHT)))
        live = [s for s in sources if s.conn is not None and not s.dropped]
    if done[0] < len(hashes):
        raise FetchError(f"base {base_id} not fetched ({done[0]} of {len(hashes)} chunks): "
                         + "; ".join([*failed, *(f"{s.addr}: {s.dropped}" for s in sources
                                                 if s.dropped)]))
