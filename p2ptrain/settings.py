"""The typed settings of a node: one frozen dataclass per section of the TOML file, and
`Settings`, all of them together.

Each field declared with `option(...)` is the option `<section>.<field>`: its default and its
help line live on the field and nowhere else (`p2ptrain.config` builds the option table from
these classes, from proto's `NodeConfig` and `GossipConfig`, and from each model's config).
`p2ptrain.config.settings_of(cfg)` builds a `Settings` from a resolved configuration; `join`,
the alone loop, `bench`, the simulator and the tests all take their settings from it. Pure:
no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2ptrain.learner import TrainConfig
from p2ptrain.models import MODELS
from p2ptrain.models.lora import DEFAULT_TARGETS, LoRAConfig
from p2ptrain.models.presets import PRESETS as MODEL_PRESETS
from p2ptrain.options import option
from p2ptrain.proto.config import PRESETS, ProtoConfig
from p2ptrain.proto.gossip.config import GossipConfig
from p2ptrain.proto.node import NodeConfig


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """[model]: which built-in model (its shape is in [model.<name>])."""

    name: str = option("rwkv", "built-in model to train", flag="--model",
                       choices=tuple(MODELS))
    preset: str = option("", "rwkv shape by name (rwkv-169m, rwkv-430m, seed-1b, rwkv-1b5); "
                         "model.rwkv.* keys set explicitly still win", flag="--preset",
                         choices=("", *MODEL_PRESETS))
    init_from: str = option("", "start from a Hugging Face RWKV-4 directory (config.json, "
                            "safetensors weights, tokenizer.json): its shape and weights; the "
                            "data must use its tokenizer", flag="--init-from")


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """[lora]: the adapters and the frozen base of train.mode = "lora"."""

    rank: int = option(16, "rank r of each adapter (A: in x r, B: r x out)", flag="--lora-rank",
                       minimum=1)
    alpha: float = option(32.0, "adapters are scaled by alpha / rank", minimum=0.0)
    targets: str = option(DEFAULT_TARGETS, "matrices that get adapters: comma-separated name "
                          "patterns (blocks.*.att.* = all of time-mix; head = the output head)")
    base: str = option("", "the frozen base: a base directory, a p2ptrain checkpoint or a "
                       "Hugging Face RWKV-4 directory (made into a base in the state "
                       "directory once), or a base id (16 hex) to fetch from the swarm; empty: "
                       "model.init_from", flag="--base")
    base_dtype: str = option("bf16", "dtype a base is written in when made from a checkpoint "
                             "or Hugging Face directory", choices=("bf16", "fp16", "fp32"))

    def adapters(self) -> LoRAConfig:
        return LoRAConfig(self.rank, self.alpha, self.targets)


@dataclass(frozen=True, slots=True)
class DataConfig:
    """[data]: the corpus."""

    path: str = option("", "text file, directory of text files or .npy tokens; empty: the "
                       "built-in Tiny Shakespeare", flag="--data")
    holdout_fraction: float = option(0.1, "tail of the corpus held out for evaluation",
                                     minimum=0.0)


@dataclass(frozen=True, slots=True)
class EvalConfig:
    """[eval]: held-out evaluation."""

    every_seconds: float = option(30.0, "held-out evaluation interval; 0: only at the end",
                                  minimum=0)
    windows: int = option(256, "held-out windows per evaluation", minimum=1)


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """[checkpoint]: when checkpoints are written and how many are kept."""

    every_seconds: float = option(120.0, "checkpoint interval; 0: off", minimum=0)
    every_steps: int = option(0, "also checkpoint every N steps; 0: off", minimum=0)
    keep: int = option(3, "checkpoints kept on disk", minimum=1)


@dataclass(frozen=True, slots=True)
class HostConfig:
    """[node], the driver's part (the protocol's part is proto's `NodeConfig`)."""

    state_dir: str = option("~/.p2ptrain", "identity and checkpoints of this node",
                            flag="--state-dir")
    grace_seconds: float = option(20.0, "time to stop cleanly after SIGINT/SIGTERM", minimum=1)
    alone: bool = option(False, "train alone: no HTTP server, no discovery, no peers",
                         flag="--alone")
    priority: int = option(0, "election priority: the live member with the highest leads "
                           "(ties: capability score, then node id)", flag="--priority")


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """[swarm]: which swarm, and its key."""

    name: str = option("", "swarm name (from `p2ptrain init`; empty: the demo swarm)")
    key_file: str = option("", "file holding the swarm key (relative to the config file's "
                           "directory)")
    token: str = option("", "join token from `p2ptrain init` (secret: prefer --token-file)",
                        flag="--token")
    token_file: str = option("", "file holding the join token (e.g. a Docker secret)",
                             flag="--token-file")
    previous_key_file: str = option("", "after `p2ptrain key rotate`: file holding the "
                                    "swarm's previous key (or token), accepted during the grace")
    previous_key_grace: float = option(3600.0, "seconds of this node's running time the "
                                       "previous key is accepted (monotonic, no date)",
                                       minimum=0)


@dataclass(frozen=True, slots=True)
class NetConfig:
    """[net]: listening, advertising, discovery, upload cap, protocol timing."""

    port: int = option(7100, "TCP port of this node's HTTP API", flag="--port", minimum=0,
                       maximum=65535)
    bind: str = option("0.0.0.0", "address the HTTP API listens on", flag="--bind")
    advertise: str = option("", "address peers should use to reach this node (empty: the "
                            "--bind address if it names one, else this machine's address "
                            "on the route toward the first --peer, or the default route)",
                            flag="--advertise")
    peers: str = option("", "static seed peers, HOST:PORT separated by commas; a DNS name "
                        "stands for all its addresses", flag="--peer")
    mdns: bool = option(True, "find peers on the LAN by mDNS")
    outbound_only: bool = option(False, "this node cannot accept connections (NAT, "
                                 "firewall): it starts every exchange and never leads",
                                 flag="--outbound-only")
    max_upload_mbps: float = option(0.0, "cap on this node's upload, Mbit/s; 0: none",
                                    flag="--max-upload-mbps", minimum=0)
    timing: str = option("lan", "protocol timing preset: lan, wan (Starlink, internet) or "
                         "local (tests)", choices=tuple(PRESETS))
    open_routes: bool = option(True, "serve /v1/status, /v1/history, /metrics and the "
                               "dashboard without authentication (read-only; /v1/health "
                               "is always open)")
    max_connections: int = option(512, "connections the HTTP API keeps open at once (also at "
                                  "most half the open-file limit); idle ones make room for new "
                                  "ones", minimum=8)
    max_connections_per_ip: int = option(64, "connections one IP address may keep open at "
                                         "once", minimum=1)
    header_timeout: float = option(10.0, "seconds a connection may take to send a request "
                                   "head", minimum=0.1)
    idle_timeout: float = option(60.0, "seconds an idle keep-alive connection is kept",
                                 minimum=0.1)
    body_grace: float = option(10.0, "seconds of slack a request body gets before it must "
                               "keep min_body_rate_kib; also the longest it may fall "
                               "silent (three of them: wait for memory, then 503)",
                               minimum=0.1)
    min_body_rate_kib: float = option(8.0, "KiB/s a request body must average after its "
                                      "grace (slower: 408)", minimum=0.01)
    body_memory_mib: float = option(64.0, "MiB of gradient and averaging request bodies held "
                                    "in memory at once, verified or not (a body read alone "
                                    "may exceed it; past half full, one address holds at "
                                    "most half)", minimum=1)
    refused_seconds: float = option(60.0, "exit 2 (wrong swarm key) when every peer has "
                                    "refused this node (HTTP 401) this long (seeds, and "
                                    "members that once answered it); 0: never", minimum=0)

    def seeds(self) -> list[str]:
        """The static seed peers, in the order given."""
        return [p.strip() for p in self.peers.split(",") if p.strip()]


@dataclass(frozen=True, slots=True)
class LogConfig:
    """[log]: progress output."""

    format: str = option("text", "progress output format", flag="--log-format",
                         choices=("text", "json"))
    every_seconds: float = option(5.0, "progress line interval", minimum=0.1)


# TOML section -> the dataclasses whose option fields make it up, in `config show` order
SECTIONS: tuple[tuple[str, type], ...] = (
    ("model", ModelChoice), ("data", DataConfig), ("train", TrainConfig), ("lora", LoraSettings),
    ("eval", EvalConfig), ("checkpoint", CheckpointConfig), ("node", HostConfig),
    ("node", NodeConfig), ("swarm", SwarmConfig), ("net", NetConfig),
    ("gossip", GossipConfig), ("log", LogConfig),
)


@dataclass(frozen=True, slots=True)
class Settings:
    """Every section of a node's configuration, typed."""

    model_name: str  # [model] name
    model: Any  # the chosen model's config dataclass ([model.<name>])
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    host: HostConfig
    node: NodeConfig  # its `gossip` is the [gossip] section
    swarm: SwarmConfig
    net: NetConfig
    log: LogConfig
    init_from: str = ""  # [model] init_from: a Hugging Face RWKV-4 directory, or ""
    lora: LoraSettings = LoraSettings()  # [lora], used when train.mode is "lora"

    @property
    def gossip(self) -> GossipConfig:
        return self.node.gossip

    def proto(self) -> ProtoConfig:
        """The control plane's timing: the preset of `net.timing`, with the leader's
        checkpoint interval from `checkpoint.every_seconds` (0: never)."""
        every = self.checkpoint.every_seconds
        return PRESETS[self.net.timing].with_(checkpoint_interval=every if every > 0 else 1e12)
