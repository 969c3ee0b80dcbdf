"""Hosts made of Linux network namespaces on one bridge, for driver tests (needs root).

A `NetLab` owns everything it creates — namespaces, veth pairs, a bridge, the processes it
started — and removes all of it on exit, even when the test body raised or the run got
SIGTERM/SIGHUP (tests/conftest.py turns those into KeyboardInterrupt; a signal arriving during
the removal waits for its end); cleanup logs to stderr and never raises. Names are unique
per process and lab, so parallel runs never collide.
mDNS needs nothing more than this: zeroconf picks the interface itself, no multicast route.
"""

from __future__ import annotations

import atexit
import functools
import ipaddress
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import pytest

_lab_numbers = itertools.count()  # makes every lab of this process unique
_IFNAMSIZ = 15  # longest Linux interface name
_STOP_GRACE = 3.0  # seconds a process gets between SIGTERM and SIGKILL
# held back while a lab is removed: their handlers (Ctrl-C's KeyboardInterrupt, SIGTERM's and
# SIGHUP's in tests/conftest.py) would stop the removal half-way, and nothing would finish it
_DEFERRED = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
# ... and since that mask is the closing thread's only (with another thread alive the kernel
# may hand it the signal, and Python runs the handler in this thread all the same), the
# conftest handler also asks `defer_signal` first: while a removal runs, it is said after
_removing = 0  # removals running
_said_after: list[str] = []  # the signal a removal holds back, by name


def defer_signal(name: str) -> bool:
    """Whether a lab's removal runs now (tests/conftest.py's handler then returns, and the
    removal raises KeyboardInterrupt when it ends)."""
    if _removing:
        _said_after.append(name)
    return bool(_removing)


def _base36(n: int) -> str:
    """A short lowercase rendering of a non-negative integer."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one `ip` command, capturing its output; with check, failure raises with its stderr."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


@functools.cache
def _netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (probed once)."""
    if os.geteuid() != 0:
        return "not running as root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    probe = f"nlprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "delete", probe, check=False)
    return None


def require_netns() -> None:
    """Skip the calling test when namespaces are unavailable; fail instead when CI=true."""
    reason = _netns_unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"network-namespace test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"needs root and `ip netns`: {reason}")


class NetLab:
    """n_hosts namespaces `<tag>-h<i>`, each with eth0 on one bridge and 10.a.b.(i+1)/24."""

    def __init__(self, n_hosts: int, prefix: str = "lab") -> None:
        """Choose names and a subnet; nothing is created before __enter__."""
        if not 1 <= n_hosts <= 99:
            raise ValueError("a lab has 1..99 hosts")
        self.n_hosts = n_hosts
        self._prefix = prefix[:4]
        self._name(next(_lab_numbers))
        if max(len(self.bridge), len(self.veth_host(n_hosts - 1))) > _IFNAMSIZ:
            raise ValueError(f"prefix {prefix!r} makes interface names too long")
        self._procs: list[subprocess.Popen] = []
        self._namespaces: list[str] = []  # created, so ours to delete
        self._links: list[str] = []
        self._closed = False

    def _name(self, number: int) -> None:
        """Derive the tag, bridge name and subnet from our pid and a per-process number."""
        self.tag = f"{self._prefix}{_base36(os.getpid())}{_base36(number)}"
        self.bridge = f"br-{self.tag}"
        self.subnet = self._pick_subnet(os.getpid() * 64 + number)

    def _names_taken(self) -> bool:
        """Whether a leftover (say from a SIGKILLed run with our pid) uses one of our names."""
        namespaces = {line.split()[0] for line in _ip("netns", "list").stdout.splitlines()
                      if line.strip()}
        links = [self.bridge] + [self.veth_host(i) for i in range(self.n_hosts)]
        return (any(self.ns(i) in namespaces for i in range(self.n_hosts))
                or any(_ip("link", "show", link, check=False).returncode == 0 for link in links))

    @staticmethod
    def _pick_subnet(seed: int) -> ipaddress.IPv4Network:
        """A 10.x.y.0/24 derived from seed that no host route already uses."""
        routes = _ip("-4", "route", "show", "table", "all", check=False).stdout
        used = [ipaddress.ip_network(word, strict=False) for line in routes.splitlines()
                for word in line.split()[:2] if word[:1].isdigit() and "/" in word]
        for step in range(128 * 256):
            index = (seed + step) % (128 * 256)
            net = ipaddress.IPv4Network(f"10.{64 + index // 256}.{index % 256}.0/24")
            if not any(net.overlaps(u) for u in used):
                return net
        raise RuntimeError("no free 10.64-191.x.0/24 subnet")

    def ns(self, i: int) -> str:
        """The namespace name of host i."""
        return f"{self.tag}-h{i}"

    def addr(self, i: int) -> str:
        """Host i's IPv4 address on the lab bridge."""
        return str(self.subnet.network_address + i + 1)

    def veth_host(self, i: int) -> str:
        """The host-side end of host i's veth pair (shape it with `tc` for downlink limits)."""
        return f"{self.tag}v{i}"

    def __enter__(self) -> NetLab:
        """Create the bridge, namespaces and links; on any failure remove what exists."""
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Remove everything, whatever happened in the body."""
        self.close()

    def _build(self) -> None:
        """Make the bridge and one namespace + veth pair per host."""
        while self._names_taken():
            self._name(next(_lab_numbers))
        _ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n_hosts):
            ns, veth = self.ns(i), self.veth_host(i)
            _ip("netns", "add", ns)
            self._namespaces.append(ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._links.append(veth)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(i)}/{self.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def popen(self, i: int, argv: Sequence[str], **kw) -> subprocess.Popen:
        """Start argv inside host i; the lab stops it on exit."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kw)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], **kw) -> subprocess.CompletedProcess:
        """Run argv inside host i to completion (check=True, output captured as text)."""
        kw.setdefault("check", True)
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        kw.setdefault("timeout", 60)
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *argv], **kw)

    def close(self) -> None:
        """Stop the lab's processes, then delete namespaces, veths and the bridge; never raises
        but the KeyboardInterrupt of a SIGTERM or SIGHUP held back while it ran."""
        if self._closed:
            return
        self._closed = True
        global _removing
        _removing += 1
        held = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED)  # delivered when done
        try:
            atexit.unregister(self.close)
            self._stop_processes()
            for link in reversed(self._links):  # host ends first (deleting one removes its pair)
                if _ip("link", "show", link, check=False).returncode == 0:
                    self._quietly("link", "delete", link)
            for ns in self._namespaces:
                self._quietly("netns", "delete", ns)
        finally:
            _removing -= 1
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        if not _removing and _said_after:
            name = _said_after.pop()
            _said_after.clear()
            raise KeyboardInterrupt(f"{name} received: tearing down")

    def _stop_processes(self) -> None:
        """SIGTERM everything we started (and stragglers in our namespaces), then SIGKILL."""
        for sig, grace in ((signal.SIGTERM, _STOP_GRACE), (signal.SIGKILL, 10.0)):
            pids = {p.pid for p in self._procs if p.poll() is None}
            for ns in self._namespaces:
                listed = _ip("netns", "pids", ns, check=False).stdout.split()
                pids.update(int(pid) for pid in listed if pid.isdigit())
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
                except OSError as e:
                    print(f"netlab: kill {pid}: {e}", file=sys.stderr)
            deadline = time.monotonic() + grace  # shared: processes stop in parallel
            for proc in self._procs:
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    if sig == signal.SIGKILL:
                        print(f"netlab: pid {proc.pid} survived SIGKILL", file=sys.stderr)

    @staticmethod
    def _quietly(*args: str) -> None:
        """Run a cleanup `ip` command, reporting failure on stderr instead of raising."""
        try:
            done = _ip(*args, check=False)
        except (OSError, subprocess.SubprocessError) as e:
            print(f"netlab: ip {' '.join(args)}: {e}", file=sys.stderr)
            return
        if done.returncode != 0:
            print(f"netlab: ip {' '.join(args)}: {done.stderr.strip()}", file=sys.stderr)
