"""Scenarios: the TOML files in sims/scenarios/, read into plain dataclasses and checked.

A scenario names the fleet (device groups at sites, each on WiFi or wired), the sites and
their uplinks, the model trained for real (`[model]`, the proxy) and the model charged
(`[charge]`, see charge.py), the training and protocol settings, churn, the methods to
compare (`[[methods]]`: gossip, coordinator, allreduce, solo) and, in traffic-only mode, the
sweep -- or, for a join storm, the checkpoint files every machine fetches (`[checkpoint]`)
and the `fetch` methods that move them. Every key is checked: an unknown one is an error
naming it, so a typo in a user's file never silently falls back to a default. This file
only reads and validates; it builds nothing that runs.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sims.devices import PROFILES, Device, make_device
from sims.network import UPLINKS, Site, Uplink

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
METHOD_KINDS = ("gossip", "coordinator", "allreduce", "solo", "fetch")
TOP_KEYS = {"name", "description", "seed", "mode", "duration", "target_loss", "eval_every",
            "eval_windows", "model", "charge", "train", "protocol", "sites", "nodes",
            "devices", "churn", "methods", "sweep", "jobs", "checkpoint", "base",
            "stop_at_target"}
CHECKPOINT_KEYS = {"chunk_mib", "request_bytes", "files", "fetch"}
MIB = 2**20


class ScenarioError(ValueError):
    """A scenario file is malformed; the message names the key."""


@dataclass(frozen=True)
class NodeGroup:
    device: str  # profile name (a key of [devices] or a built-in profile)
    count: int  # machines in the group
    site: str  # the site they are at
    medium: str  # "wifi" or "wired"


@dataclass(frozen=True)
class Method:
    name: str  # label in tables and plots
    kind: str  # gossip, coordinator, allreduce or solo
    params: dict[str, Any] = field(default_factory=dict)  # kind-specific knobs


@dataclass(frozen=True)
class Partition:
    at: float  # s; the split starts
    heal: float  # s; it ends
    groups: tuple[tuple[str, ...], ...]  # site names per side


@dataclass(frozen=True)
class Churn:
    failures: bool = False  # nodes fail (exponential, each device's mttf) and return
    mttf_scale: float = 1.0  # multiplies every device's mean time to failure
    mttr_scale: float = 1.0  # multiplies every device's mean time to return
    leader_kill: float | None = None  # s; the leader (the coordinator, for that baseline) dies
    leader_return: float | None = None  # s after the kill it comes back (None: never)
    partitions: tuple[Partition, ...] = ()


@dataclass(frozen=True)
class CheckpointSpec:
    """A join storm's checkpoint: the files there are and which one each device fetches."""

    chunk_bytes: int  # bytes per chunk (a file's last chunk may be shorter)
    files: dict[str, int]  # file name -> bytes (e.g. a 16-bit base, an fp32 checkpoint)
    fetch: dict[str, str]  # device name -> the file its machines fetch
    request_bytes: int = 512  # one chunk request on the wire (a Range GET and its auth)

    def scaled(self, factor: float) -> CheckpointSpec:
        """The same files `factor` times as large (for quick runs)."""
        files = {name: max(1, round(size * factor)) for name, size in self.files.items()}
        return dataclasses.replace(self, files=files)


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    seed: int
    mode: str  # "train" (real proxy training) or "traffic" (numbers only)
    duration: float  # simulated seconds per method, at most
    target_loss: float | None  # held-out nats/char the time-to-target is measured at
    eval_every: float  # simulated seconds between held-out evaluations
    eval_windows: int  # held-out windows per evaluation
    model: dict[str, Any]  # the proxy: {"model": name, config fields...}
    charge: dict[str, Any] | None  # the planned model's size (None: the proxy's)
    train: dict[str, Any]  # p2ptrain [train] overrides (lr, total_samples, ...)
    protocol: dict[str, Any]  # {"preset": "wan", ProtoConfig overrides...}
    sites: tuple[Site, ...]
    nodes: tuple[NodeGroup, ...]
    devices: dict[str, Device]
    churn: Churn
    methods: tuple[Method, ...]
    sweep: dict[str, Any]  # traffic mode: {"nodes": [...], "params": [...]}
    jobs: int  # methods run in parallel processes
    stop_at_target: bool = False  # a method's run ends at its first evaluation at the target
    checkpoint: CheckpointSpec | None = None  # join storm: the files fetched (fetch methods)
    path: Path | None = None

    def replace(self, **changes: Any) -> Scenario:
        return dataclasses.replace(self, **changes)

    @property
    def node_count(self) -> int:
        return sum(g.count for g in self.nodes)


def _check_keys(table: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(allowed))}")


def _site(raw: dict) -> Site:
    _check_keys(raw, {"name", "uplink", "wifi_latency_ms", "wired_latency_ms",
                      "lan_queue_limit"}, "[[sites]]")
    uplink_raw = raw.get("uplink", "fibre")
    if isinstance(uplink_raw, str):
        if uplink_raw not in UPLINKS:
            raise ScenarioError(f"site {raw.get('name')}: unknown uplink {uplink_raw!r}")
        uplink = UPLINKS[uplink_raw]
    else:
        base = UPLINKS.get(uplink_raw.get("kind", "fibre"))
        if base is None:
            raise ScenarioError(f"site {raw.get('name')}: unknown uplink kind")
        fields = {f.name for f in dataclasses.fields(Uplink)}
        _check_keys(uplink_raw, fields, f"site {raw.get('name')} uplink")
        uplink = dataclasses.replace(base, **uplink_raw)
    extra = {k: float(v) for k, v in raw.items() if k not in ("name", "uplink")}
    return Site(str(raw["name"]), uplink, **extra)


def _checkpoint(raw: dict, groups: list[NodeGroup], methods: list[Method],
                mode: str) -> CheckpointSpec | None:
    fetching = [m.name for m in methods if m.kind == "fetch"]
    if not raw:
        if fetching:
            raise ScenarioError(f"method {fetching[0]}: a fetch method needs [checkpoint]")
        return None
    _check_keys(raw, CHECKPOINT_KEYS, "[checkpoint]")
    if mode != "traffic" or len(fetching) != len(methods):
        raise ScenarioError("[checkpoint] goes with mode = \"traffic\" and fetch methods only")
    files = {str(k): int(float(v)) for k, v in raw.get("files", {}).items()}
    fetch = {str(k): str(v) for k, v in raw.get("fetch", {}).items()}
    for device, name in fetch.items():
        if name not in files:
            raise ScenarioError(f"[checkpoint] fetch: {device} fetches unknown file {name!r}")
    for group in groups:
        if group.device not in fetch:
            raise ScenarioError(f"[checkpoint] fetch: no file for device {group.device!r}")
    spec = CheckpointSpec(int(float(raw.get("chunk_mib", 4)) * MIB), files, fetch,
                          int(raw.get("request_bytes", 512)))
    if spec.chunk_bytes < 1 or spec.request_bytes < 1 or min(files.values(), default=0) < 1:
        raise ScenarioError("[checkpoint]: chunk, request and file sizes must be > 0")
    return spec


def parse(doc: dict, path: Path | None = None) -> Scenario:
    """A Scenario from a parsed TOML document."""
    _check_keys(doc, TOP_KEYS, "scenario")
    try:
        sites = tuple(_site(s) for s in doc.get("sites", [{"name": "site"}]))
        site_names = {s.name for s in sites}
        devices = {name: make_device(name, raw, path.parent if path else None)
                   for name, raw in doc.get("devices", {}).items()}
        for name in PROFILES:
            devices.setdefault(name, PROFILES[name])
        groups = []
        for raw in doc.get("nodes", []):
            _check_keys(raw, {"device", "count", "site", "medium"}, "[[nodes]]")
            group = NodeGroup(str(raw["device"]), int(raw.get("count", 1)),
                              str(raw.get("site", sites[0].name)), str(raw.get("medium", "wifi")))
            if group.device not in devices:
                raise ScenarioError(f"[[nodes]]: unknown device {group.device!r}")
            if group.site not in site_names or group.medium not in ("wifi", "wired"):
                raise ScenarioError(f"[[nodes]]: bad site {group.site!r} or medium")
            groups.append(group)
        churn_raw = dict(doc.get("churn", {}))
        _check_keys(churn_raw, {f.name for f in dataclasses.fields(Churn)}, "[churn]")
        partitions = tuple(
            Partition(float(p["at"]), float(p["heal"]),
                      tuple(tuple(str(s) for s in side) for side in p["groups"]))
            for p in churn_raw.pop("partitions", []))
        churn = Churn(partitions=partitions, **churn_raw)
        methods = []
        for raw in doc.get("methods", []):
            raw = dict(raw)
            name, kind = str(raw.pop("name")), str(raw.pop("kind"))
            if kind not in METHOD_KINDS:
                raise ScenarioError(f"method {name}: kind must be one of {METHOD_KINDS}")
            methods.append(Method(name, kind, raw))
        mode = str(doc.get("mode", "train"))
        if mode not in ("train", "traffic"):
            raise ScenarioError("mode must be train or traffic")
        target = doc.get("target_loss")
        checkpoint = _checkpoint(dict(doc.get("checkpoint", {})), groups, methods, mode)
        return Scenario(
            name=str(doc.get("name", path.stem if path else "scenario")),
            description=str(doc.get("description", "")),
            seed=int(doc.get("seed", 0)), mode=mode,
            duration=float(doc.get("duration", 60.0)),
            target_loss=None if target is None else float(target),
            eval_every=float(doc.get("eval_every", 2.0)),
            eval_windows=int(doc.get("eval_windows", 128)),
            model=dict(doc.get("model", {"model": "rwkv"})),
            charge=dict(doc["charge"]) if "charge" in doc else None,
            train=dict(doc.get("train", {})), protocol=dict(doc.get("protocol", {})),
            sites=sites, nodes=tuple(groups), devices=devices, churn=churn,
            methods=tuple(methods), sweep=dict(doc.get("sweep", {})),
            jobs=int(doc.get("jobs", 1)), stop_at_target=bool(doc.get("stop_at_target", False)),
            checkpoint=checkpoint, path=path)
    except ScenarioError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        where = path.name if path else "scenario"
        raise ScenarioError(f"{where}: {type(exc).__name__}: {exc}") from None


def locate(name_or_path: str) -> Path:
    """A scenario file: a path as given, or sims/scenarios/NAME.toml."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return path
    candidate = SCENARIO_DIR / f"{name_or_path}.toml"
    if candidate.exists():
        return candidate
    raise ScenarioError(f"no scenario {name_or_path!r} (known: {', '.join(available())})")


def read(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """A scenario file's TOML document; `base = "NAME"` starts from that scenario's document
    and replaces each top-level key the file sets (a table or an array of tables is replaced
    whole, never merged)."""
    if path.resolve() in seen:
        raise ScenarioError(f"{path.name}: base scenarios form a cycle")
    try:
        with path.open("rb") as f:
            doc = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ScenarioError(f"{path}: not valid TOML ({exc})") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: {exc.strerror or exc}") from None
    base = doc.pop("base", None)
    if base is None:
        return doc
    inherited = read(locate(str(base)), seen + (path.resolve(),))
    return {**inherited, **doc}


def load(name_or_path: str) -> Scenario:
    path = locate(name_or_path)
    return parse(read(path), path)


def available() -> list[str]:
    """Names of the shipped scenarios."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
