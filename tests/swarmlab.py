"""Real `p2ptrain join` processes for tests: start them, ask their HTTP API, wait on
conditions with deadlines, and always end them (also when a test fails).

Each lab makes its own swarm key (never the demo swarm), binds to loopback (or to a network
namespace's address), and turns mDNS off unless a test asks for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from p2ptrain.swarm import new_swarm
from tests.helpers import REPO

SMALL_SWARM_TOML = """\
[model]
name = "mlp"
[model.mlp]
n_hidden = 32
n_embd = 8
ctx_len = 16
[train]
batch = 8
warmup_samples = 64
total_samples = 100000000
[eval]
windows = 16
every_seconds = 1
[net]
timing = "local"
[checkpoint]
every_seconds = 2
[gossip]
codec = "topk"
fraction = 0.1
fanout = 2  # gradient gossip on (the default is averaging only): the tests watch gradients
"""


def free_ports(n: int) -> list[int]:
    """n TCP ports free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_for(what: str, check: Callable[[], Any], timeout: float, poll: float = 0.1) -> Any:
    """Poll `check()` until it returns something truthy; fail with `what` at the deadline."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError, KeyError) as exc:
            last_error = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}"
                                 + (f" (last error: {last_error})" if last_error else ""))
        time.sleep(poll)


def get_json(addr: str, path: str = "/v1/status", timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(f"http://{addr}{path}", timeout=timeout) as resp:
        return json.loads(resp.read())


class Proc:
    """One node process and where it listens."""

    def __init__(self, popen: subprocess.Popen, addr: str, state_dir: Path, log: Path):
        self.popen, self.addr, self.state_dir, self.log = popen, addr, state_dir, log

    def status(self) -> dict:
        return get_json(self.addr)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def describe(self) -> str:
        """A few lines on this node for a failed test's output: its status (if it answers),
        its evals, and its last warnings and errors."""
        lines = [f"--- node at {self.addr} ({self.log.name}), exit code {self.popen.poll()}"]
        try:
            doc = self.status()
            members = {m["node_id"][:8]: (m["state"], m.get("gradients_used"))
                       for m in doc.get("members", [])}
            lines.append(f"status: {json.dumps({k: v for k, v in doc.items() if k != 'members'})}"
                         [:2000])
            lines.append(f"members (state, gradients used): {members}")
        except (OSError, ValueError, KeyError) as exc:
            lines.append(f"no status: {exc}")
        events = self.events()
        evals = [e.get("eval_loss") for e in events if e.get("event") == "eval"]
        lines.append(f"{len(evals)} evals: first {evals[:3]}, last {evals[-3:]}")
        lines += [json.dumps(e)[:400] for e in events
                  if e.get("level") in ("warning", "error")][-8:]
        plain = [line for line in self.output().splitlines() if not line.startswith("{")]
        lines += plain[-8:]  # tracebacks and anything else not an event
        return "\n".join(lines)

    def events(self) -> list[dict]:
        out = []
        for line in self.output().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


class SwarmLab:
    """Start nodes of one fresh swarm; `close()` (or the context manager) ends them all."""

    def __init__(self, tmp: Path, config_text: str = SMALL_SWARM_TOML, name: str = "lab"):
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.swarm = new_swarm(name)
        self.config = tmp / "swarm.toml"
        self.config.write_text(config_text)
        self.procs: list[Proc] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
        env.update(OPENBLAS_NUM_THREADS="1", P2PTRAIN_TOKEN=self.swarm.token(),
                   P2PTRAIN_LOG_FORMAT="json", P2PTRAIN_NET_MDNS="false",
                   P2PTRAIN_BIND="127.0.0.1", P2PTRAIN_NODE_MIN_PEERS="1",
                   P2PTRAIN_NODE_JOIN_TIMEOUT="5", P2PTRAIN_LOG_EVERY_SECONDS="1")
        env.update(extra)
        return env

    def start(self, name: str, port: int, peers: list[str], *args: str, config: bool = True,
              env: dict[str, str] | None = None, prefix: list[str] | None = None,
              bind: str = "127.0.0.1", state: Path | None = None) -> Proc:
        state = state or self.tmp / name
        state.mkdir(exist_ok=True)
        log = self.tmp / f"{name}.log"
        argv = [*(prefix or []), sys.executable, "-m", "p2ptrain", "join", "--state-dir",
                str(state), "--port", str(port), "--bind", bind]
        if config:
            argv += ["--config", str(self.config)]
        for peer in peers:
            argv += ["--peer", peer]
        argv += list(args)
        with open(log, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                     env=env or self.env(), start_new_session=True)
        proc = Proc(popen, f"{bind}:{port}", state, log)
        self.procs.append(proc)
        return proc

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        if proc.alive():
            proc.popen.send_signal(sig)

    def stop_all(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM every node at once, wait for each; the exit codes."""
        for proc in self.procs:
            if proc.alive():
                proc.popen.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.popen.wait(timeout))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                codes.append(proc.popen.wait())
        return codes

    def close(self) -> None:
        for proc in self.procs:
            if proc.alive():
                proc.popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.popen.wait(10)

    def __enter__(self) -> SwarmLab:
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None:  # a failed test: what each node was doing, in its output
            for proc in self.procs:
                print(proc.describe())
        self.close()
