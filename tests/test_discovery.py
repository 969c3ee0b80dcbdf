"""Discovery: peer-string parsing, seed resolution, TXT screening, and real mDNS.

The mDNS tests run real zeroconf instances: in-process on 127.0.0.1 (no root needed), and in
separate processes in network namespaces on one bridge (root; see tests/netlab.py). Every
test uses fresh random swarm ids, so concurrent runs on the same machine cannot interfere.
"""

from __future__ import annotations

import asyncio
import json
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from zeroconf.asyncio import AsyncZeroconf

from p2ptrain.net.discovery import (
    SERVICE_TYPE,
    Discovery,
    format_peer,
    parse_peer,
    resolve_seeds,
)
from tests.netlab import NetLab, require_netns

DEADLINE = 20.0  # seconds; generous, discovery normally takes ~1.2-1.7 s


# --- parse_peer / resolve_seeds ----------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("10.0.0.5:7200", ("10.0.0.5", 7200)),
    ("10.0.0.5", ("10.0.0.5", 7100)),
    ("  node-3.lan  ", ("node-3.lan", 7100)),
    ("tasks.trainer:7101", ("tasks.trainer", 7101)),
    ("[fe80::1]:7300", ("fe80::1", 7300)),
    ("[::1]", ("::1", 7100)),
    ("2001:db8::7", ("2001:db8::7", 7100)),
    ("http://pi4.local:8000/ckpt/latest", ("pi4.local", 8000)),
    ("http://[2001:db8::1]:9000/", ("2001:db8::1", 9000)),
    ("https://example.org", ("example.org", 7100)),
    ("host:65535", ("host", 65535)),
])
def test_parse_peer_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_peer(text) == expected


@pytest.mark.parametrize("text", [
    "", "   ", ":7100", "host:", "host:0", "host:65536", "host:99999999", "host:abc",
    "host:71o0", "host:-1", "host:7100/x", "[::1", "[::1]x", "[nothost]:7100", "[]:7100",
    "ftp://host:21", "http://:8000/", "bad host", "host/x", "-lead.example", "a..b",
])
def test_parse_peer_rejects(text: str) -> None:
    with pytest.raises(ValueError, match=r"peer|empty"):
        parse_peer(text)


def test_parse_peer_uses_the_given_default_port() -> None:
    assert parse_peer("node", default_port=9) == ("node", 9)
    assert format_peer("::1", 9) == "[::1]:9" and format_peer("node", 9) == "node:9"


def test_resolve_seeds_expands_names_and_lists_failures() -> None:
    seeds = ["localhost:7100", "no-such-peer.invalid:7100", "10.1.2.3", "10.1.2.3:7100",
             "[::1]:7200", "host:0"]
    resolved, failed = asyncio.run(resolve_seeds(seeds, 7100))
    assert "127.0.0.1:7100" in resolved
    assert resolved.count("10.1.2.3:7100") == 1  # duplicates collapse, order kept
    assert resolved.index("127.0.0.1:7100") < resolved.index("10.1.2.3:7100")
    assert "[::1]:7200" in resolved
    assert len(failed) == 2
    assert failed[0].startswith("no-such-peer.invalid:7100: ")
    assert failed[1].startswith("host:0: ")


# --- screening advertisements (no network) ------------------------------------------------

def _discovery(swarm: str, node: str, on_found: Callable[[str, str], None] = lambda a, n: None,
               **kw) -> Discovery:
    """A loopback Discovery with the test defaults."""
    kw.setdefault("addresses", None)
    return Discovery(swarm_id=swarm, node_id=node, port=7100, device_class="test",
                     on_found=on_found, interfaces=["127.0.0.1"], **kw)


def _advert(addresses: list[str], **props: str) -> object:
    """A resolved-looking service carrying the given TXT properties."""
    from zeroconf.asyncio import AsyncServiceInfo
    return AsyncServiceInfo(SERVICE_TYPE, f"p2ptrain-x.{SERVICE_TYPE}", port=7100,
                            properties=props, parsed_addresses=addresses)


def test_txt_screening() -> None:
    swarm, me, peer = secrets.token_hex(8), secrets.token_hex(16), secrets.token_hex(16)
    d = _discovery(swarm, me)
    good = {"v": "1", "swarm": swarm, "node": peer, "port": "7300", "class": "pi4"}
    assert d._peer_of(_advert(["10.0.0.2", "fe80::2"], **good)) == ("10.0.0.2:7300", peer)
    assert d._peer_of(_advert(["fe80::2", "10.0.0.2"], **good)) == ("10.0.0.2:7300", peer)
    assert d._peer_of(_advert(["2001:db8::2"], **good)) == ("[2001:db8::2]:7300", peer)
    assert d._peer_of(_advert([], **good)) == "no_address"
    cases = {
        "other_swarm": {"swarm": secrets.token_hex(8)},
        "version": {"v": "2"},
        "self": {"node": me},
        "malformed": {"node": "xyz"},
    }
    for reason, change in cases.items():
        assert d._peer_of(_advert(["10.0.0.2"], **{**good, **change})) == reason, reason
    for bad in ({"port": "0"}, {"port": "70000"}, {"port": "http"}, {"node": peer.upper()}):
        assert d._peer_of(_advert(["10.0.0.2"], **{**good, **bad})) == "malformed", bad
    for missing in ("v", "swarm", "node", "port", "class"):
        props = {k: v for k, v in good.items() if k != missing}
        assert d._peer_of(_advert(["10.0.0.2"], **props)) == "malformed", missing


def test_reports_are_debounced_and_callback_errors_are_contained() -> None:
    calls: list[tuple[str, str]] = []

    def on_found(addr: str, node: str) -> None:
        calls.append((addr, node))
        raise RuntimeError("a buggy callback must not break discovery")

    d = _discovery(secrets.token_hex(8), secrets.token_hex(16), on_found)
    node = secrets.token_hex(16)
    d._report("10.0.0.2:7100", node)
    d._report("10.0.0.2:7100", node)
    d._report("10.0.0.3:7100", node)
    assert calls == [("10.0.0.2:7100", node), ("10.0.0.3:7100", node)]


def test_constructor_rejects_bad_identity() -> None:
    node = secrets.token_hex(16)
    for bad in ({"swarm": "not-hex"}, {"node": "abc"}, {"node": node.upper()}):
        with pytest.raises(ValueError):
            _discovery(bad.get("swarm", "ab12"), bad.get("node", node))


# --- real mDNS on loopback ------------------------------------------------------------------

async def _until(condition: Callable[[], bool], what: str, deadline: float = DEADLINE) -> None:
    """Wait until condition() holds, failing after deadline seconds."""
    end = time.monotonic() + deadline
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {deadline:g} s waiting for {what}")
        await asyncio.sleep(0.02)


async def _loopback_swarm() -> None:
    """Two peers of one swarm find each other; a third, of another swarm, is only ignored."""
    swarm, other = secrets.token_hex(8), secrets.token_hex(8)
    ids = [secrets.token_hex(16) for _ in range(3)]
    found: list[dict[str, str]] = [{}, {}, {}]
    events = [asyncio.Event() for _ in range(3)]
    t0 = time.monotonic()

    def recorder(i: int) -> Callable[[str, str], None]:
        def on_found(addr: str, node: str) -> None:
            found[i][node] = addr
            events[i].set()
            print(f"loopback: node {i} found {addr} after {time.monotonic() - t0:.2f} s")
        return on_found

    nodes = [_discovery(swarm, ids[0], recorder(0)), _discovery(swarm, ids[1], recorder(1)),
             _discovery(other, ids[2], recorder(2))]
    try:
        await asyncio.gather(*(n.start() for n in nodes))
        await asyncio.wait_for(asyncio.gather(events[0].wait(), events[1].wait()), DEADLINE)
        await _until(lambda: all(n.ignored["other_swarm"] >= 1 for n in nodes),
                     "every node to see and ignore the other swarm")
    finally:
        for n in nodes:
            await n.close()
    assert found[0] == {ids[1]: "127.0.0.1:7100"}
    assert found[1] == {ids[0]: "127.0.0.1:7100"}
    assert found[2] == {}
    assert all(n.ignored["self"] >= 1 for n in nodes[:2])


def test_loopback_peers_find_each_other_and_ignore_another_swarm() -> None:
    asyncio.run(_loopback_swarm())


async def _lifecycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() before start() is a no-op; a start that fails half-way still closes cleanly."""
    swarm = secrets.token_hex(8)
    never_started = _discovery(swarm, secrets.token_hex(16))
    await never_started.close()
    with pytest.raises(RuntimeError):
        await never_started.start()

    async def refuse(self: AsyncZeroconf, info: object) -> None:
        raise OSError("injected: registration failed")

    half = _discovery(swarm, secrets.token_hex(16))
    with monkeypatch.context() as patch:
        patch.setattr(AsyncZeroconf, "async_register_service", refuse)
        try:
            with pytest.raises(OSError, match="injected"):
                await half.start()  # sockets open and browser running by now
            with pytest.raises(RuntimeError):
                await half.start()
        finally:
            await half.close()
    await half.close()
    assert half._aiozc is None


def test_lifecycle_is_once_and_close_survives_a_failed_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    asyncio.run(_lifecycle(monkeypatch))


def test_constructor_rejects_bad_addresses() -> None:
    with pytest.raises(ValueError, match="not an IP"):
        _discovery(secrets.token_hex(8), secrets.token_hex(16), addresses=["pi4.local"])


# --- real mDNS between network namespaces --------------------------------------------------

PEER_SCRIPT = '''
import asyncio, json, sys, time
from p2ptrain.net.discovery import Discovery

async def main(swarm, node, expect, deadline):
    t0 = time.monotonic()
    found = {}
    def on_found(addr, peer):
        if peer not in found:
            found[peer] = addr
            print(json.dumps({"found": addr, "node": peer, "t": time.monotonic() - t0}),
                  flush=True)
    d = Discovery(swarm_id=swarm, node_id=node, port=7100, addresses=None,
                  device_class="test", on_found=on_found)
    stdin = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    end = t0 + deadline
    done = False
    try:
        await d.start()
        # Ready once the peers are found and the other swarm was seen; polled, as ignoring
        # has no callback. Then stay up until released (stdin closed) so that no peer's
        # goodbye can race a slower peer's discovery.
        while time.monotonic() < end:
            if len(found) >= expect and d.ignored["other_swarm"] >= 1:
                done = True
                print(json.dumps({"done": time.monotonic() - t0}), flush=True)
                await asyncio.wait_for(stdin.read(), end - time.monotonic())
                break
            await asyncio.sleep(0.02)
    finally:
        print(json.dumps({"final": {"found": found, "ignored": dict(d.ignored)}}), flush=True)
        await d.close()
    sys.exit(0 if done else 3)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
'''


def _pump(name: int, stream, out: queue.Queue) -> None:
    """Forward each stdout line of one process to the queue as (name, line)."""
    for line in stream:
        out.put((name, line))


@pytest.mark.processes
@pytest.mark.netns
def test_netns_hosts_find_exactly_their_swarm(tmp_path: Path) -> None:
    require_netns()
    script = tmp_path / "peer.py"
    script.write_text(PEER_SCRIPT)
    swarm, other = secrets.token_hex(8), secrets.token_hex(8)
    ids = [secrets.token_hex(16) for _ in range(4)]
    lines: queue.Queue = queue.Queue()
    events: list[list[dict]] = [[] for _ in range(4)]
    with NetLab(4, "disc") as lab:
        procs, pumps = [], []
        for i in range(4):
            argv = [sys.executable, str(script), other if i == 3 else swarm, ids[i],
                    "0" if i == 3 else "2", str(DEADLINE)]
            proc = lab.popen(i, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            pumps.append(threading.Thread(target=_pump, args=(i, proc.stdout, lines), daemon=True))
            pumps[-1].start()
            procs.append(proc)
        ready: set[int] = set()
        end = time.monotonic() + DEADLINE + 5
        while len(ready) < 4 and time.monotonic() < end:
            try:
                i, line = lines.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            event = json.loads(line)
            events[i].append(event)
            if "done" in event or "final" in event:
                ready.add(i)
        for proc in procs:  # release them all: each sends its goodbye and exits
            proc.stdin.close()
        codes = [proc.wait(timeout=10) for proc in procs]
        for pump in pumps:
            pump.join(timeout=10)  # they end at EOF, after the last line
        while not lines.empty():
            i, line = lines.get()
            events[i].append(json.loads(line))

    finals = [next(e["final"] for e in evs if "final" in e) for evs in events]
    for i in range(3):
        others = [j for j in range(3) if j != i]
        assert finals[i]["found"] == {ids[j]: f"{lab.addr(j)}:7100" for j in others}, i
        assert finals[i]["ignored"].get("other_swarm", 0) >= 1, finals[i]
        assert ids[3] not in finals[i]["found"]
    assert finals[3]["found"] == {}
    assert finals[3]["ignored"].get("other_swarm", 0) >= 1
    assert codes == [0, 0, 0, 0], events
    latencies = [e["t"] for evs in events for e in evs if "found" in e]
    print(f"netns discovery: first {min(latencies):.2f} s, last {max(latencies):.2f} s")


@pytest.mark.netns
def test_netlab_cleans_up_even_when_the_body_raises() -> None:
    require_netns()
    with pytest.raises(RuntimeError, match="deliberate"), NetLab(2, "clean") as lab:
        sleeper = lab.popen(0, [sys.executable, "-c", "import time; time.sleep(600)"])
        assert lab.run(1, ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout.count(lab.addr(1))
        raise RuntimeError("deliberate")
    assert sleeper.poll() is not None
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert lab.tag not in namespaces and lab.tag not in links


def test_made_up_adverts_leave_bounded_state(monkeypatch) -> None:
    """Anyone on the LAN can advertise the swarm's id (it is public): 100,000 made-up
    adverts kept 100,000 debounce entries and as many failure records in the outbox, and
    each failed address wrote a warning line (600 adverts: 591 lines)."""
    from collections import Counter

    from p2ptrain.net import discovery as disc
    from p2ptrain.net.outbox import MAX_FAILING, Outbox, WarnBudget

    found = []
    d = Discovery(swarm_id="ab", node_id="0" * 32, port=7100, addresses=["127.0.0.1"],
                  device_class="laptop", on_found=lambda addr, node: found.append(addr))
    clock = [1000.0]
    monkeypatch.setattr(disc.time, "monotonic", lambda: clock[0])
    for i in range(3 * disc.MAX_REPORTED):
        clock[0] += disc.DEBOUNCE_SECONDS / disc.MAX_REPORTED  # a flood within a debounce
        d._report(f"10.0.{i // 250}.{i % 250}:7100", f"{i:032x}")
    assert len(found) == 3 * disc.MAX_REPORTED  # each reported once
    assert len(d._last_reported) <= disc.MAX_REPORTED + 1

    said = []

    class Reporter:
        def warn(self, text, **fields):
            said.append(text)

    box = Outbox.__new__(Outbox)  # the failure bookkeeping alone
    box.failures, box.stats, box.last_error = Counter(), Counter(), {}
    box.reporter, box.warned = Reporter(), WarnBudget(20, 60.0, lambda: clock[0])
    for i in range(2 * MAX_FAILING + 7):
        box._failed(f"10.1.{i // 250}.{i % 250}:7100", "/v1/members", OSError("refused"))
    assert len(box.last_error) <= MAX_FAILING and len(box.failures) <= MAX_FAILING
    assert len(said) == 20
    clock[0] += 61.0  # a minute later: the next line says how many were held back
    box._failed("10.2.0.1:7100", "/v1/members", OSError("refused"))
    assert said[-1].endswith(f"(and {2 * MAX_FAILING + 7 - 20} failed requests not shown)")


def test_a_bad_peer_is_named_as_the_peer_not_the_advertised_address():
    """`--peer 127.0.0.1:99999` said "--advertise: peer '127.0.0.1:99999': port 99999 ..."."""
    from p2ptrain.errors import UserError
    from p2ptrain.net.discovery import advertised_address

    with pytest.raises(UserError, match=r"^--peer: .*99999"):
        advertised_address("127.0.0.1:7391", "127.0.0.1", 7391, ["127.0.0.1:99999"])
    with pytest.raises(UserError, match=r"^--advertise: "):
        advertised_address("127.0.0.1:99999", "127.0.0.1", 7391, ["127.0.0.1:7000"])
