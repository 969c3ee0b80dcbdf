"""Configuration: one table of options, resolved from flags, environment, a TOML file, defaults.

Precedence: a flag overrides the environment, which overrides the file, which overrides the
default. Every option has a dotted TOML key (`train.batch` is `batch` in `[train]`), a
`P2PTRAIN_*` environment variable (named after its flag when it has one, else after its key),
and maybe a flag. The resolved Config remembers where each value came from, for
`p2ptrain config show`. An unknown key or a bad value raises ConfigError naming the key and
what it accepts. Pure apart from reading the one file it is given.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from p2ptrain.models import MODELS

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


class ConfigError(Exception):
    """A configuration value or key is wrong; the message names it and what is accepted."""


@dataclass(frozen=True, slots=True)
class Option:
    key: str  # dotted TOML key
    kind: type  # int, float, str or bool
    default: Any  # value when nothing sets it
    help: str  # one line for --help and `config show`
    flag: str | None = None  # command-line flag, e.g. "--batch"
    choices: tuple[str, ...] | None = None  # accepted values of a str option
    minimum: float | None = None  # smallest accepted value of a number

    @property
    def env(self) -> str:
        name = self.flag[2:] if self.flag else self.key
        return "P2PTRAIN_" + name.upper().replace("-", "_").replace(".", "_")

    def accepted(self) -> str:
        if self.choices:
            return "one of " + ", ".join(self.choices)
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        text = what[self.kind]
        return f"{text} >= {self.minimum:g}" if self.minimum is not None else text

    def parse(self, raw: Any, origin: str) -> Any:
        """Check and convert `raw` (a string from a flag or the environment, or a TOML value)."""
        bad = ConfigError(
            f"{origin}: {self.key} = {raw!r} is not valid; expected {self.accepted()}")
        value: Any
        if self.kind is bool:
            if isinstance(raw, bool):
                value = raw
            elif isinstance(raw, str) and raw.strip().lower() in TRUE_WORDS | FALSE_WORDS:
                value = raw.strip().lower() in TRUE_WORDS
            else:
                raise bad
        elif self.kind is int:
            if isinstance(raw, bool):
                raise bad
            try:
                value = int(raw.replace("_", "")) if isinstance(raw, str) else raw
            except ValueError:
                raise bad from None
            if not isinstance(value, int):
                raise bad
        elif self.kind is float:
            if isinstance(raw, bool):
                raise bad
            try:
                value = float(raw) if isinstance(raw, str | int | float) else None
            except ValueError:
                raise bad from None
            if value is None or value != value or value in (float("inf"), float("-inf")):
                raise bad
        else:
            if not isinstance(raw, str):
                raise bad
            value = raw
        if self.choices and value not in self.choices:
            raise bad
        if self.minimum is not None and value < self.minimum:
            raise bad
        return value


def _base_options() -> list[Option]:
    O = Option
    return [
        O("model.name", str, "rwkv", "built-in model to train", "--model", tuple(MODELS)),
        O("data.path", str, "", "text file, directory of text files or .npy tokens; "
          "empty: the built-in Tiny Shakespeare", "--data"),
        O("data.holdout_fraction", float, 0.1, "tail of the corpus held out for evaluation",
          minimum=0.0),
        O("train.batch", int, 0, "samples per step; 0: chosen from the hardware", "--batch",
          None, 0),
        O("train.accum", int, 0, "micro-batches per step; 0: chosen from memory", None, None, 0),
        O("train.lr", float, 4e-3, "peak learning rate", "--lr", None, 0),
        O("train.min_lr_ratio", float, 0.1, "cosine floor as a fraction of the peak", minimum=0),
        O("train.warmup_samples", int, 1600, "samples of linear warm-up", minimum=0),
        O("train.total_samples", int, 200_000,
          "swarm samples of the whole run: the schedule's length; the run ends there", minimum=1),
        O("train.weight_decay", float, 0.01, "decoupled weight decay on matrices", minimum=0),
        O("train.beta1", float, 0.9, "Adam first-moment decay", minimum=0),
        O("train.beta2", float, 0.99, "Adam second-moment decay", minimum=0),
        O("train.grad_clip", float, 1.0, "global gradient-norm clip; 0: off", minimum=0),
        O("train.seed", int, 0, "seed of the initial weights (the same on every node) and of "
          "the data order", "--seed", None, 0),
        O("train.steps", int, 0, "stop after this many local steps; 0: no limit", "--steps",
          None, 0),
        O("train.duration", float, 0.0, "stop after this many seconds; 0: no limit",
          "--duration", None, 0),
        O("train.target_step_seconds", float, 0.25,
          "step time the automatic batch size aims at", minimum=0.01),
        O("eval.every_seconds", float, 30.0, "held-out evaluation interval; 0: only at the end",
          minimum=0),
        O("eval.windows", int, 256, "held-out windows per evaluation", minimum=1),
        O("checkpoint.every_seconds", float, 120.0, "checkpoint interval; 0: off", minimum=0),
        O("checkpoint.every_steps", int, 0, "also checkpoint every N steps; 0: off", minimum=0),
        O("checkpoint.keep", int, 3, "checkpoints kept on disk", minimum=1),
        O("node.state_dir", str, "~/.p2ptrain", "identity and checkpoints of this node",
          "--state-dir"),
        O("node.grace_seconds", float, 20.0, "time to stop cleanly after SIGINT/SIGTERM",
          minimum=1),
        O("node.alone", bool, False, "train alone: no HTTP server, no discovery, no peers",
          "--alone"),
        O("node.priority", int, 0, "election priority: the live member with the highest "
          "leads (ties: capability score, then node id)", "--priority"),
        O("node.min_peers", int, 1, "peers to find before training starts (or after "
          "node.join_timeout seconds, alone)", minimum=0),
        O("node.join_timeout", float, 10.0, "seconds to wait for node.min_peers and for the "
          "leader's checkpoint before training from the local state", minimum=0),
        O("swarm.name", str, "", "swarm name (from `p2ptrain init`; empty: the demo swarm)"),
        O("swarm.key_file", str, "", "file holding the swarm key (relative to the config "
          "file's directory)"),
        O("swarm.token", str, "", "join token from `p2ptrain init` (secret: prefer "
          "--token-file)", "--token"),
        O("swarm.token_file", str, "", "file holding the join token (e.g. a Docker secret)",
          "--token-file"),
        O("net.port", int, 7100, "TCP port of this node's HTTP API", "--port", None, 0),
        O("net.bind", str, "0.0.0.0", "address the HTTP API listens on", "--bind"),
        O("net.advertise", str, "", "address peers should use to reach this node "
          "(empty: the first non-loopback address)", "--advertise"),
        O("net.peers", str, "", "static seed peers, HOST:PORT separated by commas; a DNS "
          "name stands for all its addresses", "--peer"),
        O("net.mdns", bool, True, "find peers on the LAN by mDNS"),
        O("net.outbound_only", bool, False, "this node cannot accept connections (NAT, "
          "firewall): it starts every exchange and never leads", "--outbound-only"),
        O("net.max_upload_mbps", float, 0.0, "cap on this node's upload, Mbit/s; 0: none",
          "--max-upload-mbps", None, 0),
        O("net.timing", str, "lan", "protocol timing preset: lan, wan (Starlink, internet) or "
          "local (tests)", None, ("lan", "wan", "local")),
        O("net.open_routes", bool, True, "serve /v1/status, /metrics and the dashboard "
          "without authentication (read-only)"),
        O("gossip.codec", str, "topk", "gradient codec (when gossip.fanout > 0)", None,
          ("none", "fp16", "bf16", "int8", "topk", "randomk", "qsgd")),
        O("gossip.fraction", float, 0.01, "share of coordinates topk/randomk send",
          minimum=0),
        O("gossip.fanout", int, 0, "peers each gradient is pushed to; 0 (the default, best in "
          "the simulator): parameter averaging only", minimum=0),
        O("gossip.average_every", int, 5, "local steps between parameter averagings; "
          "0: never", minimum=0),
        O("gossip.averaging", str, "subset_fp16", "averaging exchange: all coordinates or a "
          "seeded subset, in fp32 or fp16", None,
          ("full", "fp16", "subset", "subset_fp16")),
        O("gossip.subset_fraction", float, 0.1, "share of coordinates a subset averaging "
          "exchange covers", minimum=0),
        O("gossip.average_part", int, 1 << 21, "coordinates per averaging message: a big "
          "model's exchange travels as parts of this size", minimum=1024),
        O("gossip.max_staleness_samples", int, 32768, "peer gradients older than this many "
          "swarm samples are dropped", minimum=0),
        O("log.format", str, "text", "progress output format", "--log-format", ("text", "json")),
        O("log.every_seconds", float, 5.0, "progress line interval", minimum=0.1),
    ]


def _model_options() -> list[Option]:
    """One option per numeric field of each built-in model's config dataclass."""
    out = []
    for name, (config_cls, _model_cls) in MODELS.items():
        defaults = config_cls()
        for f in dataclasses.fields(config_cls):
            if f.name == "vocab_size":
                continue
            value = getattr(defaults, f.name)
            kind = type(value)
            if kind not in (int, float, bool):
                continue
            help_text = f.metadata.get("help", f"{name} model: {f.name.replace('_', ' ')}")
            out.append(Option(f"model.{name}.{f.name}", kind, value, help_text,
                              minimum=None if kind is bool else 0))
    return out


OPTIONS: dict[str, Option] = {o.key: o for o in _base_options() + _model_options()}


@dataclass(frozen=True)
class Config:
    values: Mapping[str, Any]  # option key -> value
    sources: Mapping[str, str]  # option key -> "default", "file PATH", "env NAME", "flag --x"

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def section(self, name: str) -> SimpleNamespace:
        """Options under `name.` as attributes: cfg.section("train").batch."""
        prefix = name + "."
        return SimpleNamespace(**{k[len(prefix):]: v for k, v in self.values.items()
                                  if k.startswith(prefix) and "." not in k[len(prefix):]})

    def model_config(self):
        """The selected model's config dataclass, filled from `model.<name>.*`."""
        name = self.values["model.name"]
        config_cls, _ = MODELS[name]
        prefix = f"model.{name}."
        return config_cls(**{k[len(prefix):]: v for k, v in self.values.items()
                             if k.startswith(prefix)})


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            flat.update(_flatten(v, key + "."))
        else:
            flat[key] = v
    return flat


def _unknown_key(key: str, origin: str) -> ConfigError:
    close = difflib.get_close_matches(key, OPTIONS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    section = key.rpartition(".")[0]
    siblings = sorted(k for k in OPTIONS if k.rpartition(".")[0] == section)
    listing = f" Keys in [{section}]: {', '.join(siblings)}." if siblings and not close else ""
    return ConfigError(f"{origin}: unknown key {key!r}{hint}{listing}")


def read_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return _flatten(table)


def resolve(config_file: str | None, env: Mapping[str, str], flags: Mapping[str, Any],
            adopted: Mapping[str, Any] | None = None, adopted_from: str = "the swarm") -> Config:
    """Combine defaults < adopted < file < environment < flags. `flags` maps option keys to
    raw values of the flags that were given; `adopted` is a swarm's configuration fetched from
    a peer (`GET /v1/config`), checked here like a file."""
    values = {k: o.default for k, o in OPTIONS.items()}
    sources = dict.fromkeys(OPTIONS, "default")
    for key, raw in (adopted or {}).items():
        origin = f"configuration of {adopted_from}"
        if key not in OPTIONS or not key.startswith(SWARM_KEY_PREFIXES):
            raise ConfigError(f"{origin}: {key!r} is not a swarm-wide option")
        values[key] = OPTIONS[key].parse(raw, origin)
        sources[key] = f"swarm {adopted_from}"
    if config_file:
        origin = f"config file {config_file}"
        for key, raw in read_file(Path(config_file).expanduser()).items():
            if key not in OPTIONS:
                raise _unknown_key(key, origin)
            values[key] = OPTIONS[key].parse(raw, origin)
            sources[key] = f"file {config_file}"
    known_env = {o.env: o for o in OPTIONS.values()}
    for name, raw in env.items():
        if not name.startswith("P2PTRAIN_") or name in NON_OPTION_ENV:
            continue
        if name not in known_env:
            close = difflib.get_close_matches(name, known_env, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"environment: unknown variable {name}{hint}")
        option = known_env[name]
        values[option.key] = option.parse(raw, f"environment {name}")
        sources[option.key] = f"env {name}"
    for key, raw in flags.items():
        option = OPTIONS[key]
        values[key] = option.parse(raw, f"flag {option.flag}")
        sources[key] = f"flag {option.flag}"
    if not 0.0 < values["data.holdout_fraction"] < 1.0:
        raise ConfigError("data.holdout_fraction must lie strictly between 0 and 1")
    return Config(values, sources)


# Variables that are not options: the config file itself, and switches for tests.
NON_OPTION_ENV = {"P2PTRAIN_CONFIG", "P2PTRAIN_FAULT"}

# Options every member of a swarm must share: `GET /v1/config` serves them to a node that
# joins with only a token. Everything else (data, batch, ports, codec) may differ per node.
SWARM_KEY_PREFIXES = ("model.", "train.lr", "train.min_lr_ratio", "train.warmup_samples",
                      "train.total_samples", "train.weight_decay", "train.beta1", "train.beta2",
                      "train.grad_clip", "train.seed", "checkpoint.", "gossip.", "net.timing",
                      "swarm.name")


def swarm_options(cfg: Config) -> dict[str, Any]:
    """The swarm-wide part of a configuration, as served by `GET /v1/config`."""
    return {k: v for k, v in cfg.values.items() if k.startswith(SWARM_KEY_PREFIXES)}


def config_file_from(flag_value: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    return flag_value or env.get("P2PTRAIN_CONFIG") or None


def to_toml(cfg: Config, with_sources: bool = True) -> str:
    """The effective configuration as TOML, each value annotated with where it came from."""
    lines: list[str] = []
    section = None
    for key in OPTIONS:
        sec, _, name = key.rpartition(".")
        if sec != section:
            lines.append(("\n" if lines else "") + f"[{sec}]")
            section = sec
        value = cfg.values[key]
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        line = f"{name} = {text}"
        if with_sources:
            line = f"{line:<44} # {cfg.sources[key]}"
        lines.append(line)
    return "\n".join(lines) + "\n"
