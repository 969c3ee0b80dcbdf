import tomllib

import pytest

from p2ptrain.config import OPTIONS, ConfigError, resolve, to_toml


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nbatch = 4\nlr = 0.5\nseed = 9\n")
    cfg = resolve(str(f), {"P2PTRAIN_BATCH": "16", "P2PTRAIN_LR": "0.25"}, {"train.batch": "32"})
    assert cfg["train.batch"] == 32 and cfg.sources["train.batch"] == "flag --batch"
    assert cfg["train.lr"] == 0.25 and cfg.sources["train.lr"] == "env P2PTRAIN_LR"
    assert cfg["train.seed"] == 9 and cfg.sources["train.seed"] == f"file {f}"
    assert cfg["train.accum"] == OPTIONS["train.accum"].default
    assert cfg.sources["train.accum"] == "default"


def test_keys_without_flags_have_environment_variables():
    assert OPTIONS["checkpoint.keep"].env == "P2PTRAIN_CHECKPOINT_KEEP"
    assert OPTIONS["node.state_dir"].env == "P2PTRAIN_STATE_DIR"
    cfg = resolve(None, {"P2PTRAIN_CHECKPOINT_KEEP": "7", "P2PTRAIN_MODEL_RWKV_N_LAYER": "2"}, {})
    assert cfg["checkpoint.keep"] == 7 and cfg.model_config().n_layer == 2


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nbacth = 4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.bacth'.*'train.batch'"):
        resolve(str(f), {}, {})
    with pytest.raises(ConfigError, match="P2PTRAIN_BATCH"):
        resolve(None, {"P2PTRAIN_BACTH": "1"}, {})


@pytest.mark.parametrize("key,raw,match", [
    ("model.name", "gpt9", "one of rwkv, mlp"),
    ("train.batch", "-1", r"integer in \[0, 16,777,216\]"),
    ("train.batch", "1" + "0" * 20, r"integer in \[0, 16,777,216\]"),  # numpy refused it
    ("net.port", "99999", r"integer in \[0, 65,535\]"),  # bind() raised OverflowError
    ("train.lr", "1" + "0" * 400, "a number"),  # float() raised OverflowError
    ("model.rwkv.n_embd", "0", "integer >= 1"),  # the model raised ValueError
    ("node.state_dir", "", "a non-empty string"),  # "" was the current directory
    ("train.lr", "fast", "a number"),
    ("log.format", "xml", "one of text, json"),
    ("train.duration", "nan", "a number"),
    ("train.beta1", "1", r"number in \[0, 0.999999\]"),  # ZeroDivisionError at the 1st step
    ("train.beta2", "1.0", r"number in \[0, 0.999999\]"),
    ("train.min_lr_ratio", "2", r"number in \[0, 1\]"),  # the rate climbed to 2x the peak
    ("model.preset", "foo", r'one of "" \(none\), rwkv-169m'),  # "one of , rwkv-169m"
])
def test_bad_values_name_the_key_and_what_is_accepted(key, raw, match):
    with pytest.raises(ConfigError, match=match) as err:
        resolve(None, {}, {key: raw})
    assert key in str(err.value)


def test_bad_toml_and_missing_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        resolve(str(f), {}, {})
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(str(tmp_path / "nope.toml"), {}, {})
    f.write_text('[train]\nbatch = "eight"\n')
    with pytest.raises(ConfigError, match="train.batch"):
        resolve(str(f), {}, {})


def test_show_output_is_toml_that_resolves_to_the_same_values(tmp_path):
    cfg = resolve(None, {"P2PTRAIN_DATA": 'a "quoted" path'}, {"train.steps": "5"})
    text = to_toml(cfg)
    assert "# flag --steps" in text and "# env P2PTRAIN_DATA" in text
    f = tmp_path / "again.toml"
    f.write_text(to_toml(cfg, with_sources=False))
    assert tomllib.loads(text)  # comments included, still TOML
    assert resolve(str(f), {}, {}).values == cfg.values


def test_odd_config_files_get_one_line_each_and_never_hang(tmp_path):
    """A FIFO hung the start, /dev/zero ran out of memory, Latin-1 bytes and a nesting 5,000
    deep were tracebacks."""
    import os

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[swarm]\nname = "caf\xe9"\n')
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 5000 + "]" * 5000 + "\n")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (2 << 20))
    for path, reason in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                         (latin, "not UTF-8"), (deep, "nested too deep"),
                         (big, "larger than 1 MiB"), (tmp_path, "not a regular file")):
        with pytest.raises(ConfigError, match=reason):
            resolve(str(path), {}, {})


def test_a_presets_shape_travels_through_init_show_and_adoption(tmp_path):
    """The default shape (4 x 128) was written by `init`, shown by `config show` and served
    to nodes joining with a token -- and, set there, it beat the preset as if a user had set
    it: every such node trained the 0.92M default instead of the preset's 92.5M."""
    from p2ptrain.cli.swarmcmds import _swarm_toml
    from p2ptrain.config import swarm_options

    def shape(cfg):
        c = cfg.model_config()
        return c.n_layer, c.n_embd, c.ffn_mult

    first = resolve(None, {"P2PTRAIN_PRESET": "rwkv-169m"}, {})
    assert shape(first) == (12, 768, 4) and first["model.rwkv.n_layer"] == 12
    adopter = resolve(None, {}, {}, adopted=swarm_options(first), adopted_from="a peer")
    assert shape(adopter) == (12, 768, 4)
    shown = tmp_path / "shown.toml"
    shown.write_text(to_toml(first))
    assert shape(resolve(str(shown), {}, {})) == (12, 768, 4)
    written = tmp_path / "swarm.toml"
    written.write_text(_swarm_toml(first, "s"))
    assert shape(resolve(str(written), {}, {})) == (12, 768, 4)
    edited = written.read_text().replace('preset = "rwkv-169m"', 'preset = "rwkv-430m"')
    written.write_text(edited)  # a later edit of the preset still changes the shape
    assert shape(resolve(str(written), {}, {})) == (24, 1024, 4)
    own = resolve(None, {"P2PTRAIN_PRESET": "rwkv-169m", "P2PTRAIN_MODEL_RWKV_N_LAYER": "2"}, {})
    assert shape(own) == (2, 768, 4)  # a key set by the user still wins
