"""The live dashboard (GET /): the page is self-contained, and in headless Chromium (Debian's
`chromium`) a live 2-node swarm's page shows a loss chart with points, both nodes in the
member table, recent events, and values that move between two reads.

Without chromium the browser test skips with the reason, except under CI=true, where it fails
(bootstrap/setup.sh --test installs it). DASHBOARD_SCREENSHOT=path also saves a screenshot of
the page (docs/dashboard.png was made so).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from p2ptrain.net.dashboard import PAGE
from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, get_json, wait_for

SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def test_the_page_needs_nothing_from_elsewhere():
    """No script, style, image or font from another address; only the node's own routes."""
    assert re.findall(r"https?://[^\s\"'`]+", PAGE) == [SVG_NAMESPACE]
    assert not re.search(r"<(script|link|img|iframe)[^>]*(src|href)=", PAGE)
    assert set(re.findall(r"\"(/v1/[a-z]+)\"", PAGE)) == {"/v1/status", "/v1/history"}


def chromium() -> str:
    """The chromium command, or skip (fail under CI=true) when it is missing."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    reason = "no chromium (apt-get install chromium; bootstrap/setup.sh --test does, as root)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def browse(url: str, profile: Path, *extra: str) -> str:
    """Load `url` in headless chromium for 8 s of virtual time (the page polls every 2 s);
    its stdout (the DOM, with --dump-dom)."""
    run = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                          "--no-first-run", f"--user-data-dir={profile}",
                          "--virtual-time-budget=8000", *extra, url],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


class Page(HTMLParser):
    """What a test reads of the dashboard's DOM: the points of each chart's series, the member
    rows (node id -> {cell key: text}) and the kinds of the events listed."""

    def __init__(self, dom: str):
        super().__init__()
        self.chart: str | None = None
        self.points: dict[tuple[str, str], int] = {}
        self.rows: dict[str, dict[str, str]] = {}
        self.events: list[str] = []
        self._row: str | None = None
        self._cell: str | None = None
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "svg":
            self.chart = a.get("id")
        elif tag == "path" and "data-series" in a:
            self.points[(self.chart, a["data-series"])] = int(a["data-n"])
        elif tag == "tr" and "data-node" in a:
            self._row = a["data-node"]
            self.rows[self._row] = {}
        elif tag == "td" and self._row:
            self._cell = a.get("data-k")
            self.rows[self._row][self._cell] = ""
        elif tag == "li" and "data-event" in a:
            self.events.append(a["data-event"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._row = None
        elif tag == "td":
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._row and self._cell:
            self.rows[self._row][self._cell] += data


@pytest.mark.slow
@pytest.mark.processes
def test_the_dashboard_of_a_live_swarm_in_a_browser(tmp_path):
    chromium()  # skip (or fail in CI) before starting anything
    # with train.ema: the loss chart also draws what checkpoints carry
    with SwarmLab(tmp_path / "lab", SMALL_SWARM_TOML.replace("[train]\n",
                                                            "[train]\nema = 0.99\n")) as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [])
        b = lab.start("b", ports[1], [a.addr])
        wait_for("both nodes to train and see each other", lambda: all(
            s["step"] > 10 and any(m["state"] == "alive" for m in s["members"])
            for s in (a.status(), b.status())), 90)
        ids = [a.status()["node_id"], b.status()["node_id"]]
        wait_for("a few seconds of history", lambda: len(
            get_json(a.addr, "/v1/history")["points"]) >= 3, 60)
        url = f"http://{a.addr}/"
        first = Page(browse(url, tmp_path / "profile", "--dump-dom"))
        assert first.points[("loss-chart", "training")] > 0, first.points
        assert first.points[("net-chart", "down")] > 0
        wait_for("an evaluation of the average", lambda: len([
            p for p in get_json(a.addr, "/v1/history")["points"]
            if p.get("average_eval_loss") is not None]) >= 2, 60)
        averaged = Page(browse(url, tmp_path / "profile", "--dump-dom"))
        assert averaged.points[("loss-chart", "checkpoints (average)")] >= 2, averaged.points
        assert set(first.rows) == set(ids), first.rows
        mine = first.rows[ids[0]]
        assert int(mine["step"]) > 10 and re.fullmatch(r"\d+\.\d{3}", mine["loss"]), mine
        assert first.rows[ids[1]]["rtt"].endswith(" ms")
        assert {"leader", "member_up"} & set(first.events), first.events
        wait_for("the node to train on", lambda: a.status()["step"] > int(mine["step"]), 60)
        second = Page(browse(url, tmp_path / "profile", "--dump-dom"))
        assert int(second.rows[ids[0]]["step"]) > int(mine["step"])
        assert second.points[("loss-chart", "training")] >= first.points[
            ("loss-chart", "training")]
        if os.environ.get("DASHBOARD_SCREENSHOT"):
            shot = Path(os.environ["DASHBOARD_SCREENSHOT"]).resolve()
            browse(url, tmp_path / "profile", "--hide-scrollbars", "--window-size=1280,900",
                   f"--screenshot={shot}")
        assert all(code == 0 for code in lab.stop_all())


def _status(**kw) -> dict:
    member = {"node_id": "b" * 64, "addr": "10.0.0.2:7000", "state": "alive",
              "device_class": "cpu", "outbound_only": False, "leader": False, "step": 5,
              "loss": 2.5, "samples": 100, "samples_per_s": 1.0, "rtt_ms": 1.2}
    return {"node_id": "a" * 64, "device_class": "cpu", "phase": "running", "step": 7,
            "loss": 2.1, "eval_loss": 2.2, "samples": 50, "swarm_samples": 150,
            "leader": "a" * 64, "term": 1, "members": [member], "swarm": "demo",
            "addr": "127.0.0.1:7000", "outbound_only": False, "upload_bytes": 100,
            "total_samples": 1000, "average_eval_loss": None} | kw


def _history(losses: list[float]) -> dict:
    points = [{"t": float(t), "step": t, "loss": loss, "eval_loss": None,
               "average_eval_loss": None, "samples": t, "swarm_samples": 3 * t, "bytes_in": t,
               "bytes_out": t, "upload_bytes": t, "in_per_s": 1.0, "out_per_s": 2.0,
               "samples_per_s": 3.0} for t, loss in enumerate(losses, 1)]
    return {"now": len(losses) + 1.0, "spacing": 1.0, "points": points, "member_rates": {},
            "events": []}


def _serve_page(status: dict, history: dict, port: int, answer_status=None):
    """The real page and dashboard.dumps, with the given documents (or `answer_status()`'s
    status), in a thread of its own; returns a function that stops it."""
    import asyncio
    import threading

    from aiohttp import web

    from p2ptrain.net.dashboard import dumps

    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def page(_):
        return web.Response(text=PAGE, content_type="text/html")

    async def st(_):
        doc = status if answer_status is None else await answer_status()
        return web.json_response(doc, dumps=dumps)

    async def hist(_):
        return web.json_response(history, dumps=dumps)

    async def start():
        app = web.Application()
        app.router.add_get("/", page)
        app.router.add_get("/v1/status", st)
        app.router.add_get("/v1/history", hist)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        return runner

    runner = []
    thread = threading.Thread(target=lambda: (runner.append(loop.run_until_complete(start())),
                                              loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(30)

    def stop():
        asyncio.run_coroutine_threadsafe(runner[0].cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    return stop


def _banner(dom: str) -> str:
    found = re.search(r'<span id="banner">([^<]*)</span>', dom)
    return found.group(1) if found else ""


@pytest.mark.slow
@pytest.mark.processes
def test_the_page_survives_flat_losses_and_non_finite_figures(tmp_path):
    """Losses one float step apart made the grid loop forever (the tab froze); a NaN or an
    Infinity in a document blanked the page (browsers refuse them in JSON)."""
    chromium()
    (port,) = free_ports(1)
    cases = {
        "flat": (_status(), _history([2.0, 2.0000000000000004] * 3)),
        "non-finite": (_status(eval_loss=float("inf"), loss=float("nan")),
                       _history([3.0, float("inf"), 2.5, 2.4])),
    }
    for name, (status, history) in cases.items():
        stop = _serve_page(status, history, port)
        try:
            dom = browse(f"http://127.0.0.1:{port}/", tmp_path / name, "--dump-dom")
        finally:
            stop()
        page = Page(dom)
        assert _banner(dom) == "", (name, _banner(dom))
        assert page.points[("loss-chart", "training")] >= 3, (name, page.points)
        assert "b" * 64 in page.rows, name


@pytest.mark.slow
@pytest.mark.processes
def test_a_node_that_hangs_turns_the_banner_on(tmp_path):
    """A paused node (SIGSTOP, a wedged loop) still takes connections: the page's requests
    never ended and it showed the last figures for good, with no warning. Real time here
    (headless chromium's virtual time stands still while a request is pending), read over
    the DevTools protocol until the banner says so, with a deadline."""
    import asyncio
    import json
    import time
    import urllib.request

    import aiohttp

    calls = []

    async def hangs_after_two():
        calls.append(1)
        if len(calls) > 2:
            await asyncio.sleep(600)
        return _status()

    port, debug = free_ports(2)
    stop = _serve_page(_status(), _history([3.0, 2.9, 2.8]), port, hangs_after_two)
    browser = subprocess.Popen([chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                                "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
                                f"--remote-debugging-port={debug}",
                                "--remote-debugging-address=127.0.0.1", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def banner_after_hang() -> str:
        tabs = wait_for("the browser's DevTools", lambda: json.load(urllib.request.urlopen(
            f"http://127.0.0.1:{debug}/json", timeout=2)), 60)
        url = next(t for t in tabs if t["type"] == "page")["webSocketDebuggerUrl"]
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            ids = iter(range(1, 10**6))

            async def call(method: str, **params) -> dict:
                n = next(ids)
                await ws.send_json({"id": n, "method": method, "params": params})
                async for message in ws:
                    answer = json.loads(message.data)
                    if answer.get("id") == n:
                        return answer
                raise AssertionError("DevTools closed")

            await call("Page.navigate", url=f"http://127.0.0.1:{port}/")
            end, text = time.monotonic() + 90, ""
            while "node unreachable" not in text and time.monotonic() < end:
                await asyncio.sleep(0.5)  # polling a condition with a deadline
                got = await call("Runtime.evaluate",
                                 expression="document.getElementById('banner').textContent")
                text = got.get("result", {}).get("result", {}).get("value") or ""
            return text

    try:
        text = asyncio.run(banner_after_hang())
    finally:
        browser.terminate()
        browser.wait(30)
        stop()
    assert len(calls) >= 3 and "node unreachable" in text, (calls, text)
