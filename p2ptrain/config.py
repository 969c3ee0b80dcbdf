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
from typing import Any

from p2ptrain.fsutil import NotRegularFile, TooLarge, read_regular
from p2ptrain.learner import LORA_EMA
from p2ptrain.models import MODELS, presets
from p2ptrain.options import option_meta
from p2ptrain.proto.gossip.config import LORA_AVERAGE_FAST_SHARE, GossipConfig
from p2ptrain.proto.node import NodeConfig
from p2ptrain.settings import (
    SECTIONS,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    HostConfig,
    LogConfig,
    LoraSettings,
    NetConfig,
    Settings,
    SwarmConfig,
    TrainConfig,
)

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}

# Options whose default differs in LoRA mode (applied by `resolve` where nothing sets them;
# `p2ptrain init` leaves them out of swarm.toml unless set, so a later mode change gets them).
LORA_DEFAULTS = {"train.ema": LORA_EMA, "gossip.average_fast_share": LORA_AVERAGE_FAST_SHARE}


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
    maximum: float | None = None  # largest accepted value of a number

    @property
    def env(self) -> str:
        name = self.flag[2:] if self.flag else self.key
        return "P2PTRAIN_" + name.upper().replace("-", "_").replace(".", "_")

    def accepted(self) -> str:
        if self.choices:
            return "one of " + ", ".join(c or '"" (none)' for c in self.choices)
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
        text = what[self.kind]
        if self.kind is str and self.default:
            text = "a non-empty string"
        if self.minimum is not None and self.maximum is not None:
            lo, hi = (f"{v:,}" if self.kind is int else f"{v:g}"
                      for v in (self.minimum, self.maximum))
            return f"{text} in [{lo}, {hi}]"
        return f"{text} >= {self.minimum:g}" if self.minimum is not None else text

    def parse(self, raw: Any, origin: str) -> Any:
        """Check and convert `raw` (a string from a flag or the environment, or a TOML value)."""
        shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:77] + "..."
        bad = ConfigError(
            f"{origin}: {self.key} = {shown} is not valid; expected {self.accepted()}")
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
            except (ValueError, OverflowError):  # an int too big for a float
                raise bad from None
            if value is None or value != value or value in (float("inf"), float("-inf")):
                raise bad
        else:
            if not isinstance(raw, str) or (not raw.strip() and self.default):
                raise bad  # empty where a default exists: a mistake (state_dir "" was the cwd)
            value = raw
        if self.choices and value not in self.choices:
            raise bad
        if self.minimum is not None and value < self.minimum:
            raise bad
        if self.maximum is not None and value > self.maximum:
            raise bad
        return value


def _section_options() -> list[Option]:
    """One option per `option(...)` field of the settings dataclasses (settings.SECTIONS):
    key, default and help come from the field, the kind from its default."""
    out = []
    for section, cls in SECTIONS:
        for f in dataclasses.fields(cls):
            meta = option_meta(f)
            if meta is None:
                continue
            out.append(Option(f"{section}.{f.name}", type(f.default), f.default, meta["help"],
                              meta["flag"], meta["choices"], meta["minimum"],
                              meta.get("maximum")))
    return out


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
                              minimum={bool: None, int: 1}.get(kind, 0)))
    return out


def _table(options: list[Option]) -> dict[str, Option]:
    table: dict[str, Option] = {}
    for o in options:
        if o.key in table:
            raise RuntimeError(f"option {o.key} is declared twice")
        table[o.key] = o
    return table


OPTIONS: dict[str, Option] = _table(_section_options() + _model_options())


@dataclass(frozen=True)
class Config:
    values: Mapping[str, Any]  # option key -> value
    sources: Mapping[str, str]  # option key -> "default", "file PATH", "env NAME", "flag --x"

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def model_config(self):
        """The selected model's config dataclass, filled from `model.<name>.*`."""
        name = self.values["model.name"]
        config_cls, _ = MODELS[name]
        prefix = f"model.{name}."
        config = config_cls(**{k[len(prefix):]: v for k, v in self.values.items()
                               if k.startswith(prefix)})
        preset = self.values.get("model.preset")
        if not preset:
            return config
        if name != "rwkv":
            raise ConfigError(f"model.preset {preset!r} is an rwkv shape; model.name is {name}")
        explicit = {k[len(prefix):] for k, source in self.sources.items()
                    if k.startswith(prefix) and source != "default"
                    and not source.startswith(PRESET_SOURCE)}
        return presets.apply(preset, config, explicit)


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


MAX_CONFIG_BYTES = 1 << 20  # a config file is a few kB


def read_file(path: Path) -> dict[str, Any]:
    """The file's options, flattened; ConfigError (one line) for anything but a regular file
    of UTF-8 TOML up to 1 MiB -- a FIFO hung the start, /dev/zero ran out of memory, Latin-1
    bytes and a nesting 5,000 deep were tracebacks."""
    try:
        table = tomllib.loads(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror or exc}") from None
    except NotRegularFile:
        raise ConfigError(f"config file {path} is not a regular file") from None
    except TooLarge:
        raise ConfigError(f"config file {path} is larger than 1 MiB: not a config file?") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        why = exc if isinstance(exc, tomllib.TOMLDecodeError) else "nested too deep"
        raise ConfigError(f"config file {path} is not valid TOML: {why}") from None
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
        # a bool option without a flag of its own is switched off by --no-NAME (--no-mdns)
        flag = option.flag or f"--no-{key.rpartition('.')[2]}"
        values[key] = option.parse(raw, f"flag {flag}")
        sources[key] = f"flag {flag}"
    if not 0.0 < values["data.holdout_fraction"] < 1.0:
        raise ConfigError("data.holdout_fraction must lie strictly between 0 and 1")
    if values["train.mode"] == "lora":  # LoRA mode's own defaults, where unset
        for key, value in LORA_DEFAULTS.items():
            if sources[key] == "default":
                values[key], sources[key] = value, "default in LoRA mode"
    if not values["train.ema"] < 1.0:
        raise ConfigError("train.ema must be below 1 (0.99 averages about the last 100 steps; "
                          "0 is off)")
    preset = values["model.preset"]
    if preset and values["model.name"] == "rwkv":  # the shape in the values, where unset: what
        for field, value in presets.shape(preset).items():  # `config show`, `init` and the
            key = f"model.rwkv.{field}"  # served swarm options say (they said 4 x 128, which
            if sources[key] == "default":  # then beat the preset as if set by the user)
                values[key], sources[key] = value, f"{PRESET_SOURCE} {preset}"
    return Config(values, sources)


PRESET_SOURCE = "model.preset"  # a value's source when a preset filled it


# Variables that are not options: the config file itself, and switches for tests.
NON_OPTION_ENV = {"P2PTRAIN_CONFIG", "P2PTRAIN_FAULT"}

# Options every member of a swarm must share: `GET /v1/config` serves them to a node that
# joins with only a token. Everything else (data, batch, ports, codec) may differ per node.
SWARM_KEY_PREFIXES = ("model.", "train.lr", "train.min_lr_ratio", "train.warmup_samples",
                      "train.total_samples", "train.weight_decay", "train.beta1", "train.beta2",
                      "train.grad_clip", "train.seed", "train.ema", "checkpoint.", "gossip.",
                      "net.timing", "swarm.name", "train.mode", "lora.rank", "lora.alpha",
                      "lora.targets", "lora.base")


def swarm_options(cfg: Config) -> dict[str, Any]:
    """The swarm-wide part of a configuration, as served by `GET /v1/config`."""
    return {k: v for k, v in cfg.values.items() if k.startswith(SWARM_KEY_PREFIXES)}


def config_file_from(flag_value: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    return flag_value or env.get("P2PTRAIN_CONFIG") or None


SECRET_KEYS = {"swarm.token"}  # shown as "<secret>" by `config show`


def to_toml(cfg: Config, with_sources: bool = True) -> str:
    """The effective configuration as TOML, each value annotated with where it came from
    (secrets masked)."""
    lines: list[str] = []
    section = None
    for key in OPTIONS:
        sec, _, name = key.rpartition(".")
        if sec != section:
            lines.append(("\n" if lines else "") + f"[{sec}]")
            section = sec
        value = cfg.values[key]
        if key in SECRET_KEYS and value:
            value = "<secret>"
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


def _fill(cls: type, cfg: Config, section: str, **extra: Any) -> Any:
    """An instance of one settings dataclass from the `section.*` options of `cfg`."""
    values = {f.name: cfg.values[f"{section}.{f.name}"] for f in dataclasses.fields(cls)
              if option_meta(f) is not None}
    try:
        return cls(**values, **extra)
    except ValueError as exc:
        raise ConfigError(f"[{section}]: {exc}") from None


def settings_of(cfg: Config) -> Settings:
    """The typed settings of a resolved configuration: the one way drivers read options."""
    gossip = _fill(GossipConfig, cfg, "gossip")
    return Settings(
        model_name=cfg.values["model.name"], model=cfg.model_config(),
        data=_fill(DataConfig, cfg, "data"), train=_fill(TrainConfig, cfg, "train"),
        eval=_fill(EvalConfig, cfg, "eval"), checkpoint=_fill(CheckpointConfig, cfg, "checkpoint"),
        host=_fill(HostConfig, cfg, "node"), node=_fill(NodeConfig, cfg, "node", gossip=gossip),
        swarm=_fill(SwarmConfig, cfg, "swarm"), net=_fill(NetConfig, cfg, "net"),
        log=_fill(LogConfig, cfg, "log"), init_from=cfg.values["model.init_from"],
        lora=_fill(LoraSettings, cfg, "lora"))
