"""The fetch's progress for people: a tqdm bar on a terminal, plain lines elsewhere; and
errors that say what happened on the way to a peer."""

from __future__ import annotations

import asyncio
import io
import socket

import aiohttp

from p2ptrain.net.fetchprogress import FetchProgress, human_bytes, human_seconds
from p2ptrain.net.neterrors import explain


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_in_a_pipe_a_plain_line_every_few_seconds_with_rate_and_eta():
    said, clock = [], Clock()
    bar = FetchProgress("fetching", say=said.append, stream=io.StringIO(), every=5.0,
                        clock=clock)
    assert not bar.terminal
    total = 1_000_000_000
    for second in range(0, 12):
        clock.t = 100.0 + second
        bar(second * 50_000_000, total, 3)
    assert said[0] == "fetching: 0% of 1.0 GB from 3 peers"
    assert said[1] == "fetching: 25% of 1.0 GB, 50.0 MB/s from 3 peers, ETA 15s"
    assert len(said) == 3  # at 0, 5 and 10 s
    clock.t = 120.0
    bar(total, total, 1)
    assert said[-1] == "fetching: 100% of 1.0 GB, 50.0 MB/s from 1 peer"


def test_on_a_terminal_a_bar_with_rate_and_eta():
    out, said, clock = io.StringIO(), [], Clock()
    bar = FetchProgress("fetching", say=said.append, stream=out, terminal=True, clock=clock)
    for i in range(1, 5):
        clock.t += 1
        bar(i * 1_000_000, 4_000_000, 2)
    bar.close()
    text = out.getvalue()
    assert "fetching" in text and "100%" in text and "4.00M" in text and "2 peers" in text
    assert said == []


def test_units():
    assert human_bytes(999) == "999 B" and human_bytes(1_500_000) == "1.5 MB"
    assert human_seconds(59) == "59s" and human_seconds(61) == "1m01s"
    assert human_seconds(7300) == "2h01m"


def test_errors_say_what_happened():
    async def connect(url: str) -> BaseException:
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)):
                    pass
            except aiohttp.ClientError as exc:
                return exc
        raise AssertionError("it should not connect")

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exc = asyncio.run(connect(f"http://127.0.0.1:{port}/"))
    assert explain(exc, f"127.0.0.1:{port}") == \
        f"nothing listens at 127.0.0.1:{port} (connection refused)"
    exc = asyncio.run(connect("http://no-such-host.invalid:7100/"))
    assert explain(exc, "no-such-host.invalid:7100").startswith("cannot resolve the host")
    assert explain(TimeoutError(), "h:1") == "h:1 stopped answering (timed out)"
