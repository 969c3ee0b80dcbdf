"""Fetching a checkpoint from every holder at once, verifying every byte, resumable.

    fetch_checkpoint(session, [leader, holder, ...], signer, out_root, expected_leader=...)

1. Hello every source (hello.py: every request names its receiver).
2. The manifest: `GET /v1/checkpoint/{prefer}` of the first source (the leader) when a name
   is preferred (the checkpoint other fetchers are on) and the leader holds it whole, else
   `GET /v1/checkpoint` of the first source (its newest); if it cannot answer,
   the newest one any other source holds that the expected leader signed. It is parsed by
   checkpoint/manifest.py (strict rules, the leader's signature). The other sources are asked
   `GET /v1/checkpoint/{id}`: the same manifest (by digest), and which chunks they hold.
3. Chunks, from all sources in parallel (`IN_FLIGHT` requests each, MAX_IN_FLIGHT in all: a
   chunk in flight is held in memory, 4 MiB, and a Pi has little; while they are all taken,
   a source at under half the best rate waits): the weights before the
   optimiser state, rarest first among partial holders, ties broken by a per-fetch random
   order (concurrent fetchers spread over different chunks and can trade them). A source
   takes the next chunk as soon as one of its requests ends, so fast links take more (work
   stealing); at the tail an idle source duplicates a chunk still in flight elsewhere when
   it would likely finish it sooner, and the first copy to arrive wins. Each answer's MAC and
   the chunk's xxh3_64 are checked before it is written.
4. Failures: a transport error, a 5xx or a bad MAC backs the source off (doubling from
   BACKOFF) and puts the chunk back for anyone; SOURCE_FAILURES in a row drop the source.
   A request that is slow where another source could do better is taken back (`_preempt`,
   not a failure): after GRACE, when a source is measured RATE_SPREAD times faster than
   the request can be going, or when the request is under MIN_RATE while a source not yet
   tried waits for a slot. A source trickling a byte a minute never times out and would
   otherwise hold the slots; a slow source alone, or several slowed alike by this node's
   own link, are never taken back.
   A source whose authentic answer carries bytes that do not match the manifest is named
   and dropped at once (its disk rotted, or it lies). "Not held here" (a partial holder)
   only takes the chunk off that source's list. A chunk that failed `chunk_retries + 1`
   times, or no source left, ends the fetch with every source's story.
5. Sources can be added while the fetch runs (`more_sources(digest)`, polled every
   SOURCE_POLL seconds, names who holds that manifest): fetchers learn of each other by
   gossip. With a `shelf`, the chunks verified so far are served to other fetchers
   (swarming), and the finished checkpoint too.

Files: partial.py (resume, progress, the final atomic rename). `files` chooses what to fetch:
a joiner needs the weights only; `checkpoint fetch` takes both by default.

Every byte from the network is hostile: bodies are read with a cap fixed before reading, JSON
is checked for shape and type before use, sizes are bounded before any file is sized.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable, Container, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import xxhash
from yarl import URL

from p2ptrain.checkpoint import manifest as mf
from p2ptrain.checkpoint.store import describe_arch
from p2ptrain.net.auth import AuthError, Receiver, RequestId, Signer
from p2ptrain.net.hello import HelloError, HelloLater, hello, key_hint
from p2ptrain.net.neterrors import explain
from p2ptrain.net.partial import (
    PARTIAL_PREFIX,
    PartialError,
    ProgressFile,
    existing,
    finish,
    resume,
    write_chunk,
)
from p2ptrain.net.shelf import Held, Shelf, is_checkpoint_name

MAX_ANSWER_BYTES = mf.MAX_MANIFEST_BYTES + 2**20  # largest {id, manifest, have} answer read
MAX_ERROR_BYTES = 64 * 2**10  # largest error body read
IN_FLIGHT = 3  # chunk requests outstanding per source (the server MACs one while sending another)
MAX_IN_FLIGHT = 12  # chunk requests outstanding in all (each holds a chunk in memory)
MAX_SOURCES = 32  # sources used at once
SOURCE_FAILURES = 4  # transient failures in a row that drop a source
BACKOFF, BACKOFF_MAX = 0.25, 8.0  # s a failing source rests: doubles per failure, up to the max
HELLO_LATER_TRIES, HELLO_LATER_WAIT = 10, 1.0  # a source busy with hellos (429): asked again
REFRESH = 1.0  # s between asking a partial holder which chunks it has now
SOURCE_POLL = 2.0  # s between looks at `more_sources`
NOT_HELD_GRACE = 30.0  # s a source that holds none of the checkpoint yet is asked again
# a slow request is taken back from its source (step 4) after GRACE s, when another is
# RATE_SPREAD times faster, or under MIN_RATE while an untried source waits for a slot
GRACE = 15.0
MIN_RATE = 16 * 1024
RATE_SPREAD = 32
# a fetch ends when for STALL s no chunk arrived and no usable source holds one still to do
# (partial holders only, the whole ones dropped): they may yet gain it, but not for ever
STALL = 60.0

__all__ = ["PARTIAL_PREFIX", "FetchError", "Fetched", "NoCheckpoint", "check_answer",
           "fetch_checkpoint", "fetch_latest"]


class FetchError(Exception):
    """A checkpoint could not be fetched; the one-line message says why."""


class NoCheckpoint(FetchError):
    """The node asked holds no checkpoint (yet): asking it again at once will not help."""


class _Retry(Exception):
    """One attempt failed in a way the next may not (transport, 5xx, MAC): back off."""


class _Drop(Exception):
    """The source must not be asked again (it served wrong bytes, or refused us)."""


class _NotHeld(Exception):
    """The source does not hold that chunk (yet)."""


class _LocalWrite(Exception):
    """This node could not write a chunk (its disk full or read-only): no source's fault, and
    the fetch ends with it (the message says so)."""


@dataclass(slots=True)
class _Conn:
    session: aiohttp.ClientSession
    base: str  # scheme://host:port[/prefix], no trailing slash
    signer: Signer
    timeout: aiohttp.ClientTimeout
    to: Receiver  # who serves at `base` (from hello; again after a 401)
    answer_timeout: aiohttp.ClientTimeout  # a JSON answer, whole: a trickle must not hold
    #                                        a fetch's start for ever
    now: Callable[[], Signer]  # the signer to say hello again with (a node's of the moment)


@dataclass(eq=False)
class Source:
    """One holder, as this fetch sees it."""

    addr: str
    conn: _Conn | None = None
    have: dict[str, set[int]] | None = None  # chunk indices it holds per file; None: all
    dropped: str = ""  # why it is not asked any more ("" while it is)
    failures: int = 0  # transient failures in a row
    retry_at: float = 0.0  # loop time before which it rests
    refreshed: float = 0.0  # loop time `have` was last asked for
    chunks: int = 0  # chunks it served us
    rate: float = 0.0  # bytes/s of one request (moving average)
    ready: asyncio.Future | None = None  # its hello, for a source added while fetching
    empty_since: float | None = None  # loop time it was first found to hold none of it

    def holds(self, chunk: mf.Chunk) -> bool:
        return self.have is None or chunk.index in self.have[chunk.file]


@dataclass
class Fetched:
    """A finished fetch: where it landed and who served what."""

    path: Path
    manifest: mf.Manifest
    served: dict[str, int] = field(default_factory=dict)  # source address -> chunks served
    dropped: dict[str, str] = field(default_factory=dict)  # source address -> why dropped


def _reason(body: bytes | memoryview) -> str:
    """The `error` text of an error body, made printable and short (it may be hostile)."""
    try:
        text = json.loads(bytes(body))["error"]
    except (ValueError, TypeError, KeyError, RecursionError):
        return "no reason given"
    if not isinstance(text, str):
        return "no reason given"
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:200])


def _printable(text: str, limit: int = 500) -> str:
    return " ".join(text.split())[:limit]


def _parse_have(doc: object, manifest: mf.Manifest) -> dict[str, set[int]] | None:
    if doc is None:
        return None
    if not isinstance(doc, dict) or set(doc) != set(mf.DATA_FILES):
        raise FetchError("checkpoint answer: `have` is malformed")
    have: dict[str, set[int]] = {}
    for name in mf.DATA_FILES:
        n, runs = len(manifest.files[name].hashes), doc[name]
        if not isinstance(runs, list) or len(runs) > n:
            raise FetchError("checkpoint answer: `have` is malformed")
        got: set[int] = set()
        end = 0  # runs in order and apart, as a holder makes them: overlapping ones would
        for run in runs:  # cost n^2 set insertions on the event loop, every refresh
            if not (isinstance(run, list) and len(run) == 2 and all(type(x) is int for x in run)
                    and end <= run[0] < run[1] <= n):
                raise FetchError("checkpoint answer: `have` is malformed")
            end = run[1]
            got.update(range(run[0], run[1]))
        have[name] = got
    return have


def check_answer(doc: object) -> tuple[str, mf.Manifest, dict[str, set[int]] | None]:
    """(id, manifest, have) of a checkpoint answer, if well-formed and validly signed."""
    if not isinstance(doc, dict) or set(doc) not in ({"id", "manifest"},
                                                     {"id", "manifest", "have"}):
        raise FetchError("checkpoint answer is not an {id, manifest, have} object")
    ckid = doc["id"]
    if not isinstance(ckid, str) or not is_checkpoint_name(ckid):
        raise FetchError("checkpoint answer carries a malformed id")
    try:
        manifest = mf.parse(doc["manifest"])
    except mf.ManifestError as exc:
        raise FetchError(f"manifest refused: {exc}") from None
    if ckid != manifest.id:
        raise FetchError(f"id {ckid} does not name the manifest's term and step")
    return ckid, manifest, _parse_have(doc.get("have"), manifest)


@dataclass(frozen=True, slots=True)
class _Answer:
    rid: RequestId  # the request this answers
    path: str  # the URL path the request was signed for
    status: int
    headers: Mapping[str, str]
    body: memoryview


async def _get(conn: _Conn, path: str, ok_status: int, limit: int, into: bytearray | None,
               byte_range: tuple[int, int] | None = None,
               timeout: aiohttp.ClientTimeout | None = None, again: bool = True) -> _Answer:
    """One signed GET of `path` under the base URL (`timeout`: conn's for chunks); its MAC is
    not checked here. Refused (401) a first time, it says hello again and asks once more (the
    source restarted, or forgot our hello among many others), if the same node answers."""
    url = URL(conn.base + path, encoded=True)
    rid, headers = conn.signer.sign_request("GET", url.path, to=conn.to)
    if byte_range is not None:
        headers["Range"] = f"bytes={byte_range[0]}-{byte_range[1]}"
    where = conn.base.removeprefix("http://")
    try:
        async with conn.session.get(url, headers=headers, timeout=timeout or conn.timeout,
                                    allow_redirects=False) as resp:
            status = resp.status
            cap = limit if status == ok_status else MAX_ERROR_BYTES
            if resp.content_length is not None and resp.content_length > cap:
                raise _Retry(f"answer {status} of {resp.content_length} bytes is too long")
            buf = into if status == ok_status and into is not None else bytearray()
            n = 0
            while piece := await resp.content.readany():
                if n + len(piece) > cap:
                    raise _Retry(f"answer {status} is longer than {cap} bytes")
                buf[n : n + len(piece)] = piece
                n += len(piece)
            body, resp_headers = memoryview(buf)[:n], resp.headers
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _Retry(explain(exc, where)) from None
    if status == 401 and again:
        signer = conn.now()  # (a node that went on under a new life: its new one)
        try:
            to = await hello(conn.session, conn.base, signer)
        except HelloLater as exc:  # busy with hellos: this request fails, the source stays
            raise _Retry(str(exc)) from None
        except HelloError as exc:
            raise _Drop(str(exc)) from None
        if to.node_id != conn.to.node_id:
            raise _Drop(f"another node answers at {where} now ({to.node_id})")
        conn.to, conn.signer = to, signer
        return await _get(conn, path, ok_status, limit, into, byte_range, timeout, again=False)
    if status == 401:
        reason = _reason(body)
        raise _Drop(f"{where} refused our authentication (401: {reason}){key_hint(reason)}")
    return _Answer(rid, url.path, status, resp_headers, body)


def _check_mac(signer: Signer, answer: _Answer) -> None:
    try:
        signer.check_response("GET", answer.path, answer.rid, answer.status, answer.headers,
                              answer.body)
    except AuthError as exc:
        raise _Retry(f"answer {answer.status} rejected: {exc.reason}") from None


def _check_and_write(signer: Signer, answer: _Answer, chunk: mf.Chunk, size: int,
                     target: Path) -> None:
    """In a worker thread: authenticate one chunk answer, check its hash, write it in place."""
    _check_mac(signer, answer)
    status, headers, body = answer.status, answer.headers, answer.body
    if status == 404:
        raise _NotHeld(_reason(body))
    if status >= 500:
        raise _Retry(f"server error {status} ({_reason(body)})")
    if status != 206:
        raise _Drop(f"answer {status} to a range request ({_reason(body)})")
    last = chunk.offset + chunk.length - 1
    if headers.get("Content-Range") != f"bytes {chunk.offset}-{last}/{size}" \
            or len(body) != chunk.length:
        raise _Drop(f"{chunk.file}: served range does not match the manifest")
    if xxhash.xxh3_64_hexdigest(body) != chunk.digest:
        raise _Drop(f"served {chunk.file} chunk {chunk.index} with bytes that do not match "
                    "the manifest")
    try:
        write_chunk(target, chunk.offset, body)
    except OSError as exc:
        raise _LocalWrite(f"cannot write {target}: {exc.strerror or exc}") from None


async def _describe(conn: _Conn, ckid: str | None) -> tuple[str, mf.Manifest,
                                                            dict[str, set[int]] | None]:
    """What the source holds: its newest checkpoint (`ckid` None) or checkpoint `ckid`."""
    path = "/v1/checkpoint" if ckid is None else f"/v1/checkpoint/{ckid}"
    answer = await _get(conn, path, 200, MAX_ANSWER_BYTES, None, timeout=conn.answer_timeout)
    _check_mac(conn.signer, answer)
    if answer.status == 404:
        raise NoCheckpoint(f"no checkpoint to fetch ({_reason(answer.body)})")
    if answer.status != 200:
        raise FetchError(f"answer {answer.status} ({_reason(answer.body)})")
    try:
        doc = json.loads(bytes(answer.body))
    except (ValueError, RecursionError):
        raise FetchError("checkpoint answer is not JSON") from None
    return check_answer(doc)


async def _learn(src: Source, manifest: mf.Manifest, now: float) -> None:
    """Ask `src` which chunks of `manifest` it holds now. A source that holds none of it yet
    (a fetcher that has only just started) is asked again later, for NOT_HELD_GRACE seconds."""
    assert src.conn is not None
    src.refreshed = now
    try:
        _, m, have = await _describe(src.conn, manifest.id)
    except NoCheckpoint:
        if src.empty_since is None:
            src.empty_since = now
        elif now - src.empty_since > NOT_HELD_GRACE:
            src.dropped = f"held none of it for {NOT_HELD_GRACE:g}s"
        src.have = {f: set() for f in mf.DATA_FILES}
        return
    except _Retry as exc:
        src.failures += 1
        src.retry_at = now + min(BACKOFF_MAX, BACKOFF * 2 ** (src.failures - 1))
        if src.failures >= SOURCE_FAILURES:
            src.dropped = f"failed {src.failures} times in a row, last: {_printable(str(exc))}"
        return
    except (_Drop, FetchError) as exc:
        src.dropped = _printable(str(exc), 300)
        return
    if m.digest != manifest.digest:
        src.dropped = "holds another manifest under the same id"
        return
    src.empty_since, src.have = None, have


async def _connect(session: aiohttp.ClientSession, src: Source,
                   signer: Signer | Callable[[], Signer], timeout: float) -> None:
    base = f"http://{src.addr}"
    now = _provider(signer)
    signer = now()
    for attempt in range(HELLO_LATER_TRIES):
        try:
            to = await hello(session, base, signer, timeout)
            break
        except HelloLater as exc:  # the source asks for a second: it answers hellos later
            if attempt + 1 == HELLO_LATER_TRIES:
                src.dropped = _printable(str(exc), 300)
                return
            await asyncio.sleep(HELLO_LATER_WAIT)
        except HelloError as exc:
            src.dropped = _printable(str(exc), 300)
            return
    src.conn = _Conn(session, base, signer,
                     aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout),
                     to, aiohttp.ClientTimeout(total=timeout, sock_connect=timeout), now)


def _provider(signer: Signer | Callable[[], Signer]) -> Callable[[], Signer]:
    return signer if callable(signer) else lambda: signer


def measured(src: Source, sample: float) -> None:
    """One more bytes/s sample of one request of `src` (a moving average)."""
    src.rate = sample if src.rate == 0 else 0.7 * src.rate + 0.3 * sample


def preempt_reason(src: Source, others: Iterable[Source], busy: Container[Source],
                   length: int, elapsed: float) -> str:
    """Why a request of `length` bytes to `src`, running `elapsed` s, should go to another
    source ("": it should not; step 4): one of `others` is measured RATE_SPREAD times faster
    than the request can be going, or it is under MIN_RATE while a source not yet tried (and
    not in `busy`) waits for a slot."""
    if elapsed < GRACE:
        return ""
    upper = length / elapsed  # the request goes at most this fast
    for other in others:
        if other is src:
            continue
        if other.rate > RATE_SPREAD * upper:
            return (f"under {upper / 1024:.0f} KiB/s after {elapsed:.0f}s; {other.addr} "
                    f"goes {other.rate / 1024:.0f} KiB/s")
        if other.rate == 0 and other not in busy and upper < MIN_RATE:
            return (f"under {upper / 1024:.0f} KiB/s after {elapsed:.0f}s, while "
                    f"{other.addr} waits untried")
    return ""


class _Run:
    """The chunk schedule of one fetch (see the module docstring, steps 3-5)."""

    def __init__(self, manifest: mf.Manifest, files: tuple[str, ...], saved: ProgressFile,
                 partial: Path, retries: int, progress: Callable[[int, int, int], None] | None,
                 rng: random.Random):
        self.manifest, self.partial, self.saved = manifest, partial, saved
        self.retries, self.progress = retries, progress
        have = saved.have
        self.chunks = [c for c in manifest.chunks(files) if c.index not in have[c.file]]
        order = list(range(len(self.chunks)))
        rng.shuffle(order)
        self.rank = {c: (files.index(c.file), r) for c, r in zip(self.chunks, order, strict=True)}
        self.todo = set(self.chunks)
        self.inflight: dict[mf.Chunk, dict[Source, tuple[asyncio.Task, float]]] = {}
        self.failed: dict[mf.Chunk, int] = {}
        self.sources: list[Source] = []
        self.total = manifest.size(files)
        self.done_bytes = self.total - sum(c.length for c in self.chunks)
        self.error: FetchError | None = None
        self.progressed = asyncio.get_running_loop().time()  # a chunk last arrived (or start)
        self.workers: set[asyncio.Task] = set()
        self._event = asyncio.Event()
        self.slots = asyncio.Semaphore(MAX_IN_FLIGHT)

    # -- waiting ------------------------------------------------------------------------------

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, seconds: float) -> None:
        event = self._event
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), max(seconds, 0.0))

    # -- choosing -----------------------------------------------------------------------------

    def usable(self) -> list[Source]:
        return [s for s in self.sources if not s.dropped and s.conn is not None]

    def _pick(self, src: Source, now: float) -> mf.Chunk | None:
        partials = [s for s in self.usable() if s.have is not None]
        best, best_key = None, None
        for c in self.todo:
            if c in self.inflight or not src.holds(c):
                continue
            rarity = sum(1 for s in partials if c.index in s.have[c.file])  # type: ignore[index]
            key = (self.rank[c][0], rarity, self.rank[c][1])
            if best_key is None or key < best_key:
                best, best_key = c, key
        if best is not None:
            return best
        # the tail: duplicate the longest-running chunk this source would likely finish sooner
        oldest, oldest_start = None, now
        for c, holders in self.inflight.items():
            if src in holders or len(holders) >= 2 or not src.holds(c):
                continue
            start = min(t for _, t in holders.values())
            expected = c.length / src.rate if src.rate > 0 else 0.0
            if now - start > expected and start < oldest_start:
                oldest, oldest_start = c, start
        return oldest

    # -- running ------------------------------------------------------------------------------

    def add(self, src: Source) -> None:
        self.sources.append(src)
        if src.conn is not None and not src.dropped:
            for _ in range(IN_FLIGHT):
                task = asyncio.ensure_future(self._worker(src))
                self.workers.add(task)
                task.add_done_callback(self.workers.discard)
        self.notify()

    async def _worker(self, src: Source) -> None:
        loop = asyncio.get_running_loop()
        while self.todo and not src.dropped and self.error is None:
            now = loop.time()
            if now < src.retry_at:
                await self.wait(src.retry_at - now)
                continue
            if self.slots.locked() and self._slow(src):  # leave the slots to faster sources
                await self.wait(REFRESH)
                continue
            async with self.slots:  # bounds the chunks held in memory at once
                started = loop.time()
                chunk = self._pick(src, started)
                if chunk is not None:
                    task = asyncio.ensure_future(self._attempt(src, chunk))
                    self.inflight.setdefault(chunk, {})[src] = (task, started)
                    try:
                        too_slow = await self._watch(src, task, chunk, started)
                    finally:
                        task.cancel()
                        holders = self.inflight.get(chunk)
                        if holders is not None:
                            holders.pop(src, None)
                            if not holders:
                                del self.inflight[chunk]
            if chunk is None:
                if src.have is not None and now - src.refreshed >= REFRESH:
                    await self._refresh(src)
                else:
                    await self.wait(REFRESH)
                continue
            if too_slow:  # taken back: not a failure (the source may just be slow)
                seconds = loop.time() - started
                measured(src, chunk.length / max(seconds, 1e-6))  # an upper bound
                src.retry_at = loop.time() + BACKOFF
                self.notify()
                continue
            if task.cancelled():
                continue  # another source delivered it first
            exc = task.exception()
            if exc is None:
                self._completed(src, chunk, loop.time() - started)
            else:
                self._failed(src, chunk, exc, loop.time())
            self.notify()

    async def _watch(self, src: Source, task: asyncio.Task, chunk: mf.Chunk,
                     started: float) -> str:
        """Wait for `task`; take it back when `_preempt` says why ("" when it ended)."""
        loop = asyncio.get_running_loop()
        while True:
            done, _ = await asyncio.wait({task}, timeout=REFRESH)
            if done:
                return ""
            why = self._preempt(src, chunk, loop.time() - started)
            if why:
                task.cancel()
                return why

    def _preempt(self, src: Source, chunk: mf.Chunk, elapsed: float) -> str:
        busy = {s for holders in self.inflight.values() for s in holders}
        return preempt_reason(src, self.usable(), busy, chunk.length, elapsed)

    def _slow(self, src: Source) -> bool:
        """Whether `src` is measured at under half the rate of the fastest source."""
        best = max((s.rate for s in self.usable()), default=0.0)
        return 0 < src.rate < best / 2

    async def _attempt(self, src: Source, chunk: mf.Chunk) -> None:
        conn = src.conn
        assert conn is not None
        path = f"/v1/checkpoint/{self.manifest.id}/{chunk.file}"
        answer = await _get(conn, path, 206, chunk.length, bytearray(chunk.length),
                            (chunk.offset, chunk.offset + chunk.length - 1))
        await asyncio.to_thread(_check_and_write, conn.signer, answer, chunk,
                                self.manifest.files[chunk.file].size, self.partial / chunk.file)

    async def _refresh(self, src: Source) -> None:
        await _learn(src, self.manifest, asyncio.get_running_loop().time())
        self.notify()

    def _completed(self, src: Source, chunk: mf.Chunk, seconds: float) -> None:
        src.failures = 0
        measured(src, chunk.length / max(seconds, 1e-6))
        if chunk not in self.todo:
            return  # a duplicate finished a moment after the first copy
        self.todo.discard(chunk)
        self.saved.add(chunk)
        src.chunks += 1
        self.done_bytes += chunk.length
        self.progressed = asyncio.get_running_loop().time()
        for task, _ in self.inflight.get(chunk, {}).values():
            task.cancel()  # the other copies are not needed any more
        if self.progress is not None:
            self.progress(self.done_bytes, self.total, len(self.usable()))

    def _failed(self, src: Source, chunk: mf.Chunk, exc: BaseException, now: float) -> None:
        where = f"{src.addr}"
        if isinstance(exc, _NotHeld):
            if src.have is None:
                src.dropped = f"no longer holds it ({_printable(str(exc), 200)})"
            else:
                src.have[chunk.file].discard(chunk.index)
            return
        if isinstance(exc, _Drop):
            src.dropped = _printable(str(exc), 300)
            return
        if isinstance(exc, _LocalWrite):  # (was re-raised: a traceback, blaming the source)
            self.error = FetchError(str(exc))
            return
        if not isinstance(exc, _Retry):
            self.error = FetchError(f"{where}: {type(exc).__name__}: {exc}")
            raise exc
        src.failures += 1
        src.retry_at = now + min(BACKOFF_MAX, BACKOFF * 2 ** (src.failures - 1))
        if src.failures >= SOURCE_FAILURES:
            src.dropped = f"failed {src.failures} times in a row, last: {_printable(str(exc))}"
        self.failed[chunk] = self.failed.get(chunk, 0) + 1
        if self.failed[chunk] > self.retries:
            self.error = FetchError(f"{chunk.file} chunk {chunk.index}: {_printable(str(exc))} "
                                    f"({self.failed[chunk]} attempts)")

    def stories(self) -> str:
        return "; ".join(f"{s.addr}: {s.dropped}" for s in self.sources if s.dropped)

    def stalled(self, now: float) -> bool:
        """No chunk for STALL s, and no usable source holds one still to do."""
        return now - self.progressed > STALL and not any(
            src.holds(c) for src in self.usable() for c in self.todo)

    async def run(self, more: Callable[[str], Iterable[str]] | None,
                  connect: Callable[[str], Source], joining: Iterable[Source] = ()) -> None:
        """Until every chunk is in, or the fetch cannot go on (FetchError). `joining`:
        sources connected but not yet asked what they hold (`_join`)."""
        loop = asyncio.get_running_loop()
        polled = loop.time()
        pending: dict[asyncio.Task, str] = {}  # sources joining -> their addresses

        def start(src: Source) -> None:
            task = asyncio.ensure_future(self._join(src))
            pending[task] = src.addr
            task.add_done_callback(lambda t: pending.pop(t, None))

        for src in joining:
            start(src)
        try:
            while self.todo:
                if self.error is not None:
                    raise self.error
                if not self.usable() and not pending and not self.workers:
                    raise FetchError(f"no holder left to fetch from ({self.stories()})")
                if not pending and self.stalled(loop.time()):
                    raise FetchError(f"no chunk for {STALL:g}s and no source holds one still "
                                     f"needed ({self.stories() or 'partial holders only'})")
                if more is not None and loop.time() - polled >= SOURCE_POLL:
                    polled = loop.time()
                    known = {s.addr for s in self.sources} | set(pending.values())
                    for addr in list(dict.fromkeys(more(self.manifest.digest)))[:MAX_SOURCES]:
                        if addr not in known and len(self.sources) + len(pending) < MAX_SOURCES:
                            start(connect(addr))
                await self.wait(SOURCE_POLL if more is not None else REFRESH)
            if self.error is not None:
                raise self.error
        finally:
            for task in (*self.workers, *pending):
                task.cancel()
            await asyncio.gather(*self.workers, *pending, return_exceptions=True)
            await self.saved.flush()

    async def _join(self, src: Source) -> None:
        """A source found while fetching: connect, learn what it holds, put it to work."""
        if src.ready is not None:
            await src.ready
        if src.conn is not None and not src.dropped:
            await _learn(src, self.manifest, asyncio.get_running_loop().time())
        self.add(src)


async def fetch_checkpoint(session: aiohttp.ClientSession, sources: list[str],
                           signer: Signer | Callable[[], Signer],
                           out_root: Path, *, expected_leader: str | None,
                           files: tuple[str, ...] = mf.DATA_FILES,
                           progress: Callable[[int, int, int], None] | None = None,
                           more_sources: Callable[[str], Iterable[str]] | None = None,
                           shelf: Shelf | None = None, chunk_retries: int = 8,
                           timeout: float = 60, seed: int | None = None,
                           prefer: str | None = None, fingerprint: str | None = None
                           ) -> Fetched:
    """Fetch the newest checkpoint of `expected_leader` (None: whatever sources[0] serves)
    from `sources` (addresses, the leader's first) into `out_root`; see the module docstring.
    `prefer`: a checkpoint name to ask the leader for first (the one other fetchers are on);
    if it does not hold it, the newest. `progress(bytes_done, bytes_total, sources_in_use)`
    is called as chunks arrive. `fingerprint`: the model's, which the manifest must name
    (NoCheckpoint before a byte of it is fetched: a joiner fetched a checkpoint of another
    model whole -- up to 2 x 256 GiB a manifest may declare -- before judging it). `signer`
    may be a function giving the node's signer of the moment: a source that refuses us (401)
    is said hello again with that one (a node gone on under a new life mid-fetch)."""
    if not sources:
        raise FetchError("no source to fetch a checkpoint from")
    if not set(files) <= set(mf.DATA_FILES) or mf.MODEL_FILE not in files:
        raise ValueError("files must include the weights and name only data files")
    if prefer is not None and not is_checkpoint_name(prefer):
        raise ValueError(f"not a checkpoint name: {prefer!r}")
    try:
        return await _fetch(session, list(dict.fromkeys(sources))[:MAX_SOURCES], signer,
                            out_root, expected_leader, files, progress, more_sources, shelf,
                            chunk_retries, timeout, seed, prefer, fingerprint)
    except (FetchError, PartialError, OSError) as exc:
        where = f"{out_root}: " if isinstance(exc, OSError) else ""
        text = _printable(f"{where}{exc}")  # one line, whatever a peer sent
        kind = NoCheckpoint if isinstance(exc, NoCheckpoint) else FetchError
        raise kind(f"checkpoint fetch from {sources[0]}: {text}") from None


def _who(i: int, src: Source) -> str:
    return "" if i == 0 else f"{src.addr}: "


async def _manifest(srcs: list[Source], expected: str | None, prefer: str | None = None
                    ) -> tuple[mf.Manifest, Source | None]:
    """The manifest to fetch, and the source that gave it (see step 2)."""
    leader = srcs[0]
    if prefer is not None and leader.conn is not None:
        with contextlib.suppress(NoCheckpoint, _Retry, _Drop, FetchError):
            _, manifest, have = await _describe(leader.conn, prefer)
            if have is None and (expected is None or manifest.leader == expected):
                leader.have = have
                return manifest, leader  # whole at the leader, signed by it
    reasons: list[str] = []  # (the first source's without its address: the error names it)
    none_held = True
    for i, src in enumerate(srcs):
        if src.conn is None:
            reasons.append(f"{_who(i, src)}{src.dropped}")
            none_held = False
            continue
        try:
            _, manifest, have = await _describe(src.conn, None)
        except NoCheckpoint as exc:
            reasons.append(f"{_who(i, src)}{exc}")
            continue
        except (_Retry, _Drop, FetchError) as exc:
            reasons.append(f"{_who(i, src)}{exc}")
            none_held = False
            continue
        if expected is not None and manifest.leader != expected:
            reasons.append(f"{_who(i, src)}manifest signed by {manifest.leader}, not the leader "
                           f"{expected}")
            none_held = False
            continue
        src.have = have
        if i == 0 or len(srcs) == 1:
            return manifest, src
        # the leader could not answer: the newest the leader signed that anyone holds
        best, best_src = manifest, src
        for other in srcs[i + 1 :]:
            if other.conn is None:
                continue
            with contextlib.suppress(_Retry, _Drop, FetchError):
                _, m, h = await _describe(other.conn, None)
                if m.leader == manifest.leader and (m.term, m.step) > (best.term, best.step):
                    best, best_src = m, other
                    other.have = h
        return best, best_src
    kind = NoCheckpoint if none_held else FetchError
    raise kind("; ".join(_printable(r, 300) for r in reasons))


async def _fetch(session, addrs: list[str], signer: Signer | Callable[[], Signer], out_root: Path,
                 expected: str | None, files: tuple[str, ...], progress, more, shelf,
                 retries: int, timeout: float, seed: int | None,
                 prefer: str | None, fingerprint: str | None) -> Fetched:
    srcs = [Source(a) for a in addrs]
    await asyncio.gather(*(_connect(session, s, signer, timeout) for s in srcs))
    if len(srcs) == 1 and srcs[0].conn is None:
        raise FetchError(srcs[0].dropped)
    manifest, giver = await _manifest(srcs, expected, prefer)
    if fingerprint is not None and manifest.fingerprint != fingerprint:
        raise NoCheckpoint(f"{manifest.id} is a checkpoint of another model "
                           f"({_printable(describe_arch(manifest))[:200]})")
    out_root.mkdir(parents=True, exist_ok=True)
    final, partial = out_root / manifest.id, out_root / f"{PARTIAL_PREFIX}{manifest.id}"
    if await asyncio.to_thread(existing, final, manifest, files):
        return Fetched(final, manifest)

    have = await asyncio.to_thread(resume, partial, manifest, files)
    saved = ProgressFile(partial, manifest.digest, have)
    held = Held(partial, manifest, have)
    if shelf is not None:
        shelf.register(held)
    rng = random.Random(seed if seed is not None
                        else f"{_provider(signer)().node_id}{time.time_ns()}")
    run = _Run(manifest, files, saved, partial, retries, progress, rng)
    loop = asyncio.get_running_loop()
    later = [s for s in srcs if s is not giver and s.conn is not None]  # step 2, meanwhile
    for src in srcs:
        if src not in later:
            src.refreshed = loop.time()
            run.add(src)

    def connect(addr: str) -> Source:
        src = Source(addr)
        src.ready = asyncio.ensure_future(_connect(session, src, signer, timeout))
        return src

    try:
        await run.run(more, connect, later)
        await asyncio.to_thread(finish, partial, final, manifest, files)
    except BaseException:
        if shelf is not None:
            shelf.unregister(held)
        raise
    whole = None if files == mf.DATA_FILES else {
        f: set(range(len(manifest.files[f].hashes))) if f in files else set()
        for f in mf.DATA_FILES}
    if shelf is not None:
        shelf.register(Held(final, manifest, whole))
    return Fetched(final, manifest, {s.addr: s.chunks for s in run.sources},
                   {s.addr: s.dropped for s in run.sources if s.dropped})


async def fetch_latest(session: aiohttp.ClientSession, base_url: str, signer: Signer,
                       out_root: Path, *, expected_leader: str | None,
                       progress: Callable[[int, int], None] | None = None,
                       chunk_retries: int = 5, timeout: float = 60) -> Path:
    """Fetch the newest checkpoint served at `base_url` (one source) into `out_root`."""
    addr = base_url.rstrip("/").removeprefix("http://")
    report = None if progress is None else (lambda done, total, _n: progress(done, total))
    fetched = await fetch_checkpoint(session, [addr], signer, out_root,
                                     expected_leader=expected_leader, progress=report,
                                     chunk_retries=chunk_retries, timeout=timeout, seed=0)
    return fetched.path
