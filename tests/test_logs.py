"""Structured logs: with `--log-format json` every line a node writes, on stdout and stderr,
is one JSON object with its time (RFC 3339), level, node id and event; text mode prints the
plain lines people read."""

from __future__ import annotations

import datetime
import io
import json

import pytest

from p2ptrain.report import Reporter
from tests.helpers import run_cli
from tests.swarmlab import SwarmLab, free_ports, wait_for


def _check_line(line: str, node_id: str | None = None) -> dict:
    doc = json.loads(line)
    assert {"time", "level", "node_id", "event", "message"} <= set(doc), doc
    when = datetime.datetime.fromisoformat(doc["time"].replace("Z", "+00:00"))
    assert when.tzinfo is not None and doc["time"].endswith("Z")
    assert doc["level"] in ("info", "warning", "error")
    if node_id is not None:
        assert doc["node_id"] == node_id
    return doc


def test_the_reporter_writes_json_lines_and_plain_text():
    out, err = io.StringIO(), io.StringIO()
    r = Reporter("json", out=out, err=err)
    r.info("before the identity", event="start")
    r.node_id = "ab" * 16
    r.warn("careful", event="disk", free=0)
    first, = out.getvalue().splitlines()
    assert _check_line(first)["node_id"] is None
    doc = _check_line(err.getvalue().splitlines()[0], "ab" * 16)
    assert (doc["level"], doc["event"], doc["free"]) == ("warning", "disk", 0)
    out, err = io.StringIO(), io.StringIO()
    text = Reporter("text", out=out, err=err)
    text.info("step 1")
    text.warn("low disk")
    assert out.getvalue() == "step 1\n" and err.getvalue() == "warning: low disk\n"


@pytest.mark.processes
def test_every_line_of_an_alone_run_is_structured(tmp_path, small_mlp_config):
    r = run_cli("join", "--config", str(small_mlp_config), "--state-dir", str(tmp_path / "s"),
                "--steps", "3", "--log-format", "json")
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    docs = [_check_line(ln) for ln in lines]
    ids = {d["node_id"] for d in docs if d["node_id"]}
    assert len(ids) == 1 and {"start", "checkpoint", "stopped"} <= {d["event"] for d in docs}


@pytest.mark.processes
def test_every_line_of_a_networked_node_is_structured(tmp_path):
    with SwarmLab(tmp_path) as lab:
        node = lab.start("n0", free_ports(1)[0], [], "--steps", "5")
        assert node.popen.wait(90) == 0
        lines = [ln for ln in node.output().splitlines() if ln.strip()]
        node_id = wait_for("the node's id in its log", lambda: next(
            (json.loads(ln)["node_id"] for ln in lines if json.loads(ln)["node_id"]), None), 5)
        for line in lines:
            _check_line(line)
        assert sum(json.loads(ln)["node_id"] == node_id for ln in lines) >= len(lines) - 2
