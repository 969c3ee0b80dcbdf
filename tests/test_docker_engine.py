"""docker/ on a real Docker engine: Debian's dockerd, started by the test, nothing else.

The test starts its own `dockerd` (Debian 12's docker.io, 20.10) in the background, with its
own data root, exec root, socket and pid file under a temporary directory, and with every
option that would touch the machine's networking off (no iptables, no forwarding, no
masquerading, no default bridge). No registry is reachable, so the base image is made from
the Debian mirror in the host's apt sources (`debootstrap --variant=minbase bookworm`, cached
as a tarball in /var/cache/p2ptrain-test, or $P2PT_TEST_CACHE, and rebuilt when missing,
unreadable or older than 30 days) and imported as local/debian:bookworm; the project's image
is built from docker/Dockerfile on that base (BASE_IMAGE) with the host's network and the
host's extra CA certificates (EXTRA_CA_CERTS), as the Dockerfile documents.

Then, against that engine, with its own swarm key (never the demo swarm), loopback only (the
nodes bind 127.0.0.1, mDNS off, seeded by each other's port), a tiny model:

- `deploy.sh init` makes the engine a swarm manager (docker swarm init, advertising
  127.0.0.1), runs `p2ptrain init` in the image and creates the secret from the token;
  `deploy.sh label` makes the engine's node eligible;
- `deploy.sh deploy` deploys docker/stack.yml (the 20.10 CLI parses it: `version: "3.8"`)
  as the global service on the host network, plus a test override (ports, loopback, tiny
  model, a 1 s health-check interval so that `healthy` comes at once); the task runs and its
  HEALTHCHECK reports healthy; `p2ptrain status --peer` from the host answers;
- a second stack from the same file, on another port with the same secret, joins the first
  node: both list each other and agree on one leader;
- `deploy.sh status`, `deploy.sh logs` (and `logs -f`, which follows) and `deploy.sh fetch`
  work against the engine (deploy.sh talks to it through DOCKER_HOST);
- `deploy.sh rm` stops the nodes: SIGTERM, exit code 0 in `docker events`' `die` event, within
  the node's grace period.

Everything the test makes goes away afterwards, also when it fails: containers, the swarm, the
daemon (and its containerd), the `docker0`/`docker_gwbridge` links with their routes, nsfs
mounts, /run/docker when the test made it, the temporary directory.

Needs root, dockerd and debootstrap (bootstrap/setup.sh --test installs docker.io and
debootstrap as root); without them the test skips with the reason, except under CI=true,
where it fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from p2ptrain.swarm import parse_token
from tests.helpers import REPO
from tests.swarmlab import free_ports, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.processes]

DOCKER_DIR = REPO / "docker"
DEPLOY = DOCKER_DIR / "deploy.sh"
IN_CI = os.environ.get("CI") == "true"
CACHE = Path(os.environ.get("P2PT_TEST_CACHE", "/var/cache/p2ptrain-test"))
ROOTFS_MAX_AGE = 30 * 86400
BASE = "local/debian:bookworm"
IMAGE = "p2ptrain:enginetest"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
HOST_LINKS = ("docker0", "docker_gwbridge")  # made by dockerd, left behind when it stops
GRACE = 20.0  # P2PTRAIN_NODE_GRACE_SECONDS in docker/stack.yml (checked below)


def unavailable(reason: str) -> None:
    """Skip, or fail under CI=true, where root, dockerd and debootstrap must be present."""
    if IN_CI:
        pytest.fail(f"cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def run(argv: list[str], timeout: float = 120, check: bool = True,
        **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))}: exit {out.returncode}\n"
                             f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


# ---- the engine -------------------------------------------------------------------------

class Engine:
    """A dockerd of the test's own: own data root, exec root, socket and pid file."""

    def __init__(self, root: Path, dockerd: str, docker: str):
        self.root = root
        self.dockerd = dockerd
        self.socket = root / "docker.sock"
        self.exec_root = root / "exec"
        self.log = root / "dockerd.log"
        self.bin = root / "bin"  # `docker` for deploy.sh: the CLI of the engine's package
        self.bin.mkdir()
        (self.bin / "docker").symlink_to(docker)
        (root / "config").mkdir()
        self.proc: subprocess.Popen | None = None

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("P2PTRAIN_", "DOCKER_"))}
        env.update(PATH=f"{self.bin}:{env.get('PATH', '/usr/bin:/bin')}",
                   DOCKER_HOST=f"unix://{self.socket}", DOCKER_CONFIG=str(self.root / "config"),
                   DOCKER_BUILDKIT="1")
        env.update(extra)
        return env

    def docker(self, *args: str, timeout: float = 120, check: bool = True,
               **kw) -> subprocess.CompletedProcess:
        return run([str(self.bin / "docker"), *args], timeout=timeout, check=check,
                   env=self.env(), **kw)

    def start(self) -> None:
        argv = [self.dockerd, "--data-root", str(self.root / "data"),
                "--exec-root", str(self.exec_root), "--pidfile", str(self.root / "dockerd.pid"),
                "--host", f"unix://{self.socket}", "--iptables=false", "--ip6tables=false",
                "--ip-forward=false", "--ip-masq=false", "--bridge=none",
                "--storage-driver=overlay2"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
        env["DOCKER_SERVICE_PREFER_OFFLINE_IMAGE"] = "1"  # no registry pull before each task
        with open(self.log, "ab") as log:
            # its own session: the managed containerd and the shims are in its process group
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"dockerd exited {self.proc.returncode}:\n{self.tail()}")
            return self.docker("info", "--format", "{{.ServerVersion}}", check=False,
                               timeout=10).returncode == 0

        wait_for("dockerd to answer", ready, 60)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def stop(self) -> None:
        """The swarm, the containers, then the daemon (SIGTERM; SIGKILL for its process group
        if it hangs)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.docker("swarm", "leave", "--force", check=False, timeout=60)
            with contextlib.suppress(Exception):
                ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
                if ids:
                    self.docker("rm", "-f", "-v", *ids, check=False, timeout=60)
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # containerd, shims: the group we made
        if self.proc.poll() is None:
            self.proc.wait(10)


def our_mounts(roots: list[Path]) -> list[str]:
    """Mount points under the given directories, deepest first."""
    points = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point = line.split()[1].encode().decode("unicode_escape")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            points.append(point)
    return sorted(points, key=len, reverse=True)


def clean_host(root: Path, made_run_docker: bool) -> list[str]:
    """What a stopped dockerd leaves behind on the host; the problems met, if any."""
    problems = []
    for point in our_mounts([root, Path("/run/docker")]):
        out = run(["umount", "-l", point], check=False)  # nsfs netns/default, data root
        if out.returncode != 0:
            problems.append(f"umount {point}: {out.stderr.strip()}")
    for link in HOST_LINKS:  # the link's routes (172.17/172.18) go with it
        if link_exists(link):
            out = run(["ip", "link", "delete", link], check=False)
            if out.returncode != 0:
                problems.append(f"ip link delete {link}: {out.stderr.strip()}")
    if made_run_docker:
        shutil.rmtree("/run/docker", ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    return problems


@pytest.fixture(scope="module")
def engine():
    if os.geteuid() != 0:
        unavailable("needs root: it starts its own dockerd")
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        unavailable("no dockerd (apt-get install docker.io; bootstrap/setup.sh --test does)")
    # the CLI of the engine's own package (Debian: /usr/bin/docker, 20.10): the stack files
    # must pass its parser; another docker earlier in PATH (a newer CLI) is not used
    packaged = Path(dockerd).resolve().parent.parent / "bin" / "docker"
    docker = str(packaged) if packaged.exists() else shutil.which("docker")
    if docker is None:
        unavailable("no docker CLI next to dockerd")
    if shutil.which("debootstrap") is None:
        unavailable("no debootstrap (apt-get install debootstrap; bootstrap/setup.sh --test "
                    "does)")
    for link in HOST_LINKS:
        if link_exists(link):
            unavailable(f"a network link {link} exists: another Docker engine runs here (or a "
                        "crashed one left it); this test's engine would share it")
    made_run_docker = not Path("/run/docker").exists()
    # short: containerd's sockets live under the exec root (108-byte limit for their paths)
    root = Path(tempfile.mkdtemp(prefix="p2pt-dkr-", dir="/tmp"))
    eng = Engine(root, dockerd, docker)
    try:
        eng.start()
        yield eng
    finally:
        try:
            eng.stop()
        finally:
            problems = clean_host(root, made_run_docker)
        assert not problems, "cleanup: " + "; ".join(problems)
        leftovers = [link for link in HOST_LINKS if link_exists(link)]
        assert not leftovers, f"links left behind: {leftovers}"


# ---- the images -------------------------------------------------------------------------

def host_mirror() -> str:
    """The Debian mirror of the host's apt sources (the archive, not -security), or
    deb.debian.org."""
    sources = Path("/etc/apt/sources.list.d")
    for path in sorted(sources.glob("*.sources")) if sources.is_dir() else []:
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if ("deb" in fields.get("Types", "").split()
                    and "bookworm" in fields.get("Suites", "").split()
                    and fields.get("Enabled", "yes") != "no"):
                return fields["URIs"].split()[0]
    for path in [Path("/etc/apt/sources.list"), *sorted(sources.glob("*.list"))]:
        if path.exists():
            for line in path.read_text().splitlines():
                m = re.match(r"\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+bookworm\s", line + " ")
                if m:
                    return m[1]
    return DEFAULT_MIRROR


def rootfs_valid(tarball: Path) -> bool:
    if not tarball.exists() or time.time() - tarball.stat().st_mtime > ROOTFS_MAX_AGE:
        return False
    try:
        with tarfile.open(tarball) as tar:
            names = set(tar.getnames())
    except (tarfile.TarError, OSError):
        return False
    return {"./etc/debian_version", "./usr/bin/apt-get", "./usr/sbin/useradd"} <= names


def debian_rootfs() -> Path:
    """A minbase Debian 12 root file system as a tarball, from the cache or made now."""
    CACHE.mkdir(parents=True, exist_ok=True)
    arch = run(["dpkg", "--print-architecture"]).stdout.strip()
    tarball = CACHE / f"debian-bookworm-minbase-{arch}.tar"
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time
        if rootfs_valid(tarball):
            return tarball
        work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=CACHE))
        try:
            rootfs = work / "rootfs"
            run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), host_mirror()],
                timeout=600)
            for junk in ("var/lib/apt/lists", "var/cache/apt"):
                for child in (rootfs / junk).glob("*"):
                    if child.is_file():
                        child.unlink()
            partial = work / "rootfs.tar"
            run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], timeout=300)
            os.replace(partial, tarball)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        assert rootfs_valid(tarball), f"{tarball}: not a usable Debian root file system"
        return tarball


def extra_ca_certs() -> str:
    """The host's own CA certificates (a TLS-intercepting proxy's, say), PEM."""
    return "".join(p.read_text() for p in sorted(Path("/usr/local/share/ca-certificates")
                                                .glob("**/*.crt")))


@pytest.fixture(scope="module")
def image(engine: Engine) -> str:
    engine.docker("import", str(debian_rootfs()), BASE, timeout=300)
    args = ["build", "--network", "host", "--build-arg", f"BASE_IMAGE={BASE}",
            "-f", str(DOCKER_DIR / "Dockerfile"), "-t", IMAGE]
    certs = extra_ca_certs()
    if certs:
        args += ["--build-arg", f"EXTRA_CA_CERTS={certs}"]
    engine.docker(*args, str(REPO), timeout=600)
    return IMAGE


# ---- helpers for the swarm --------------------------------------------------------------

def deploy(engine: Engine, *args: str, timeout: float = 120, check: bool = True,
           **env: str) -> subprocess.CompletedProcess:
    return run(["bash", str(DEPLOY), *args], timeout=timeout, check=check,
               env=engine.env(IMAGE=IMAGE, **env), cwd=engine.root)


def override(path: Path, port: int, peer: int) -> Path:
    """The test's settings on top of docker/stack.yml: loopback, no mDNS, the other stack's
    port as seed, a tiny model that trains for good, frequent checkpoints and logs, half a
    core, and a health check every second (the file's 15 s would only slow the test)."""
    doc = {"version": "3.8", "services": {"node": {
        "environment": {
            "P2PTRAIN_PORT": str(port), "P2PTRAIN_BIND": "127.0.0.1",
            "P2PTRAIN_NET_MDNS": "false", "P2PTRAIN_PEER": f"127.0.0.1:{peer}",
            "P2PTRAIN_NODE_JOIN_TIMEOUT": "2", "P2PTRAIN_NET_TIMING": "local",
            "P2PTRAIN_MODEL": "mlp", "P2PTRAIN_MODEL_MLP_N_HIDDEN": "32",
            "P2PTRAIN_MODEL_MLP_N_EMBD": "8", "P2PTRAIN_MODEL_MLP_CTX_LEN": "16",
            "P2PTRAIN_BATCH": "8", "P2PTRAIN_TRAIN_TOTAL_SAMPLES": "100000000",
            "P2PTRAIN_CHECKPOINT_EVERY_SECONDS": "1", "P2PTRAIN_LOG_EVERY_SECONDS": "1",
            "OPENBLAS_NUM_THREADS": "1"},
        "healthcheck": {"interval": "1s"},
        "deploy": {"resources": {"limits": {"cpus": "0.5", "memory": "1G"}}}}}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def containers(engine: Engine, stack: str) -> list[str]:
    """The full ids of the stack's containers (all states)."""
    return engine.docker("ps", "-aq", "--no-trunc", "--filter",
                         f"label=com.docker.stack.namespace={stack}", timeout=30).stdout.split()


def running_and_healthy(engine: Engine, stack: str) -> str | None:
    """The stack's one container once its task runs and its HEALTHCHECK passed."""
    states = engine.docker("stack", "ps", "--filter", "desired-state=running", "--format",
                           "{{.CurrentState}}", stack, timeout=30, check=False)
    if states.returncode != 0 or not states.stdout.startswith("Running"):
        return None  # no task yet ("nothing found in stack"), or not running yet
    ids = containers(engine, stack)
    if len(ids) != 1:
        return None
    health = engine.docker("inspect", "--format", "{{.State.Health.Status}}", ids[0],
                           timeout=30, check=False).stdout.strip()
    return ids[0] if health == "healthy" else None


def line_time(line: str) -> float:
    """The time of a `docker service logs --timestamps` line (RFC 3339, nanoseconds, UTC)."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z\s", line)
    if not m:
        return 0.0
    whole = datetime.strptime(m[1], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC).timestamp()
    return whole + float(f"0.{m[2] or 0}")


def status(port: int) -> dict:
    """`p2ptrain status --json` from the host, as a user would ask the node."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    out = run([sys.executable, "-m", "p2ptrain", "status", "--json", "--peer",
               f"127.0.0.1:{port}"], timeout=30, check=False, env=env, cwd=REPO)
    if out.returncode != 0:
        raise ValueError(out.stderr.strip())
    return json.loads(out.stdout)


class Lines:
    """A process's output lines, read by a thread, taken with a deadline."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def wait_for(self, what: str, match, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if match(line):
                return line
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; got:\n"
                             + "\n".join(self.seen[-30:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ---- the test ---------------------------------------------------------------------------

def test_stack_on_a_real_engine(engine: Engine, image: str, tmp_path: Path):
    stack_doc = yaml.safe_load((DOCKER_DIR / "stack.yml").read_text())
    assert float(stack_doc["services"]["node"]["environment"][
        "P2PTRAIN_NODE_GRACE_SECONDS"]) == GRACE
    swarm_dir = tmp_path / "swarm"
    name = f"enginetest-{uuid.uuid4().hex[:8]}"  # a swarm of its own, never the demo swarm
    try:
        # init: the engine becomes a swarm manager; p2ptrain init in the image; the secret
        deploy(engine, "init", name, SWARM_DIR=str(swarm_dir), ADVERTISE_ADDR="127.0.0.1")
        info = json.loads(engine.docker("info", "--format", "{{json .Swarm}}").stdout)
        assert info["LocalNodeState"] == "active" and info["ControlAvailable"] is True
        assert parse_token((swarm_dir / "token").read_text()).name == name
        assert engine.docker("secret", "ls", "--format", "{{.Name}}").stdout.split() == [
            "p2ptrain_token"]
        deploy(engine, "label", info["NodeID"], "desktop")

        p1, p2 = free_ports(2)
        started = time.monotonic()
        deploy(engine, "deploy", "--resolve-image", "never",
               "-c", str(override(tmp_path / "one.yml", p1, p2)), STACK="one")
        first = wait_for("the first stack's task to run and be healthy",
                         lambda: running_and_healthy(engine, "one"), 120, poll=0.5)
        healthy_after = time.monotonic() - started
        mode = engine.docker("service", "inspect", "--format", "{{json .Spec.Mode}}",
                             "one_node").stdout
        assert "Global" in mode, mode
        assert engine.docker("inspect", "--format", "{{.HostConfig.NetworkMode}}",
                             first).stdout.strip() == "host"
        doc = wait_for("p2ptrain status to answer", lambda: status(p1), 60, poll=0.5)
        assert doc["swarm"] == name

        # a second stack on the same file: another port, the same secret; it joins
        deploy(engine, "deploy", "--resolve-image", "never",
               "-c", str(override(tmp_path / "two.yml", p2, p1)), STACK="two")
        second = wait_for("the second stack's task to run and be healthy",
                          lambda: running_and_healthy(engine, "two"), 120, poll=0.5)

        def one_leader() -> str | None:
            a, b = status(p1), status(p2)
            if a["node_id"] not in {m["node_id"] for m in b.get("members", [])}:
                return None
            if b["node_id"] not in {m["node_id"] for m in a.get("members", [])}:
                return None
            leader = a.get("leader")
            ok = leader and leader == b.get("leader") and leader in (a["node_id"], b["node_id"])
            return leader if ok else None

        leader = wait_for("both nodes to see each other and agree on one leader", one_leader,
                          90, poll=0.5)

        # deploy.sh against the engine: status, logs (and following them), fetch
        out = deploy(engine, "status", f"127.0.0.1:{p2}", STACK="one")
        assert "one_node" in out.stdout and "global" in out.stdout, out.stdout
        assert f"swarm '{name}'" in out.stdout and leader[:12] in out.stdout, out.stdout
        logs = deploy(engine, "logs", STACK="one")
        assert "training mlp" in logs.stdout + logs.stderr, logs.stdout[-2000:]
        since = time.time()
        follow = Lines(["bash", str(DEPLOY), "logs", "-f"], engine.env(STACK="two"))
        try:
            follow.wait_for("the log's tail", lambda line: "training mlp" in line, 30)
            follow.wait_for("a progress line written after `logs -f` started (it follows)",
                            lambda line: "| step " in line and line_time(line) > since, 30)
            assert follow.proc.poll() is None, "logs -f must keep following"
        finally:
            follow.close()
        model = tmp_path / "model"

        def fetched() -> bool:
            got = deploy(engine, "fetch", str(model), f"127.0.0.1:{p2}",
                         SWARM_DIR=str(swarm_dir), check=False, timeout=90)
            if got.returncode != 0:
                raise ValueError(got.stderr.strip()[-500:])
            return True

        wait_for("deploy.sh fetch of the leader's checkpoint", fetched, 90, poll=1)
        (checkpoint,) = model.iterdir()
        assert {"manifest.json", "model.safetensors"} <= {p.name for p in checkpoint.iterdir()}
        assert json.loads((checkpoint / "manifest.json").read_text())["leader"] == leader

        # stopping: SIGTERM, exit 0 within the node's grace period, read from docker events
        removed_at = time.time_ns()
        # --since: events from then on, those before the subscription too (no race)
        events = Lines([str(engine.bin / "docker"), "events", "--format", "{{json .}}",
                        "--since", f"{removed_at // 10**9}.{removed_at % 10**9:09d}",
                        "--filter", "type=container", "--filter", "event=die",
                        "--filter", f"container={first}", "--filter", f"container={second}"],
                       engine.env())
        try:
            for stack in ("one", "two"):
                deploy(engine, "rm", STACK=stack)
            died = {}
            while len(died) < 2:
                line = events.wait_for("the nodes' die events",
                                       lambda line: line.startswith("{"), GRACE + 15)
                event = json.loads(line)
                died[event["Actor"]["Attributes"]["com.docker.stack.namespace"]] = event
        finally:
            events.close()
        for stack, event in died.items():
            code = event["Actor"]["Attributes"]["exitCode"]
            after = (event["timeNano"] - removed_at) / 1e9
            assert code == "0", f"{stack}: exit code {code} after SIGTERM"
            assert after < GRACE, f"{stack}: died {after:.1f}s after stack rm (grace {GRACE:g}s)"
        # the 20.10 daemon does not wait in `stack rm`: poll until the containers are gone
        wait_for("the stacks' containers to be gone",
                 lambda: not containers(engine, "one") and not containers(engine, "two"), 60)
        print(f"healthy {healthy_after:.1f}s after deploy; leader {leader[:12]}; "
              f"stopped in {max((e['timeNano'] - removed_at) / 1e9 for e in died.values()):.1f}s")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- dockerd log (tail) ---\n{engine.tail()}") from None
