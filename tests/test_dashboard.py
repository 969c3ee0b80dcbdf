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
