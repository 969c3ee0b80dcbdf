"""Typed settings: every option's default and help live on a dataclass field, `settings_of`
builds the typed sections from a resolved configuration, and a simulator scenario accepts a
node's TOML keys."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from p2ptrain.config import OPTIONS, ConfigError, resolve, settings_of
from p2ptrain.options import option_meta
from p2ptrain.proto import GossipConfig, NodeConfig
from p2ptrain.settings import SECTIONS, TrainConfig
from sims.charge import ModelSize
from sims.fleet import train_settings
from sims.gossip import split_params
from sims.scenario import load as load_scenario


def test_every_option_comes_from_a_field_with_its_default_and_help():
    from_fields = set()
    for section, cls in SECTIONS:
        defaults = cls()
        for f in dataclasses.fields(cls):
            meta = option_meta(f)
            if meta is None:
                continue
            key = f"{section}.{f.name}"
            from_fields.add(key)
            assert OPTIONS[key].default == getattr(defaults, f.name), key
            assert OPTIONS[key].help == meta["help"] and meta["help"], key
    model_keys = {k for k in OPTIONS if k.count(".") == 2 and k.startswith("model.")}
    assert set(OPTIONS) == from_fields | model_keys


def test_settings_of_types_every_section():
    cfg = resolve(None, {"P2PTRAIN_LR": "0.25"},
                  {"gossip.fanout": "2", "node.join_timeout": "3"})
    s = settings_of(cfg)
    assert isinstance(s.train, TrainConfig) and s.train.lr == 0.25
    assert s.gossip.fanout == 2 and s.node.gossip is s.gossip
    assert s.node.join_timeout == 3.0 and s.node.min_peers == NodeConfig().min_peers
    assert s.gossip.codec_params == {"fraction": GossipConfig().fraction}
    assert s.proto().checkpoint_interval == s.checkpoint.every_seconds


def test_a_cross_field_rule_of_a_section_is_a_config_error():
    cfg = resolve(None, {}, {})
    cfg = dataclasses.replace(cfg, values={**cfg.values, "gossip.clip_multiple": 5.0,
                                           "gossip.absurd_norm_multiple": 2.0})
    with pytest.raises(ConfigError, match=r"\[gossip\].*absurd_norm_multiple"):
        settings_of(cfg)


def test_derived_constants_are_computed_not_copied():
    node = NodeConfig(average_timeout=50.0)  # the longest give-up of a part is the maximum
    assert node.average_request_timeout == pytest.approx(0.9 * node.gossip.average_timeout_max)
    fixed = NodeConfig(average_timeout=50.0, gossip=GossipConfig(average_timeout_max=20.0))
    assert 0 < fixed.average_request_timeout < fixed.average_timeout  # a maximum below: fixed


def test_a_node_toml_section_pastes_into_a_simulator_method():
    node_toml = tomllib.loads("[gossip]\nfanout = 1\nfraction = 0.003\naverage_every = 3\n"
                              "[node]\naverage_timeout = 30.0\n")
    flat = {**node_toml["gossip"], **node_toml["node"]}
    for params in (flat, node_toml):  # pasted under [[methods]] as keys, or as tables
        gossip, node = split_params(params, 384.0)
        assert (gossip.fanout, gossip.average_every) == (1, 3)
        assert gossip.codec_params == {"fraction": 0.003}
        assert node.average_timeout == 30.0
        assert gossip.averaging == "subset_int8"  # auto, for a fully trained model
    with pytest.raises(ValueError, match="fanot"):
        split_params({"gossip": {"fanot": 1}}, 384.0)


def test_auto_averaging_is_resolved_by_the_charged_models_compute_per_coordinate():
    """A simulated method with the default (auto) averages as a node of the charged model
    would: LoRA on a big base covers every coordinate, full training a 10% subset; a mode
    set by hand is kept."""
    lora, full = (s.charge for s in (load_scenario("seed-1b-lora"), load_scenario("seed-100m")))
    per = {name: ModelSize.from_spec(spec) for name, spec in (("lora", lora), ("full", full))}
    modes = {name: split_params({}, m.flops_per_sample / m.params)[0].averaging
             for name, m in per.items()}
    assert modes == {"lora": "int8", "full": "subset_int8"}, modes
    fixed, _ = split_params({"averaging": "subset"}, per["lora"].flops_per_sample / 1.0)
    assert fixed.averaging == "subset"


def test_a_scenario_train_table_uses_the_node_keys():
    scenario = load_scenario("ci")
    train = train_settings(scenario)
    assert isinstance(train, TrainConfig)
    assert train.total_samples == scenario.train["total_samples"]
    bad = dataclasses.replace(scenario, train={"learning_rate": 1.0})
    with pytest.raises(ValueError, match="learning_rate"):
        train_settings(bad)
