"""models/hf.py and `p2ptrain export`: our rwkv against transformers' RwkvForCausalLM.

Small random HF models are built locally from an RwkvConfig (nothing is downloaded), saved
with save_pretrained and read with load_hf; ours are exported and loaded with
from_pretrained; logits must agree to 1e-4 either way. HF's own initialisation leaves the
norms at 1/0 and every time_first at 1.0, so every tensor is perturbed (seeded): a swapped,
mis-transposed or mis-signed tensor then changes the logits. Under CI=true a missing torch
or transformers fails these tests; elsewhere they skip with the install command.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from p2ptrain.checkpoint.safetensors_io import write_safetensors
from p2ptrain.models.hf import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    HFFormatError,
    config_from_hf,
    config_to_hf,
    export_hf,
    load_hf,
)
from p2ptrain.models.presets import PILE_VOCAB, PRESETS
from p2ptrain.models.presets import params as preset_params
from p2ptrain.models.rwkv import RWKV, RWKVConfig
from p2ptrain.sample import generate
from tests.helpers import REPO, cli_env, run_cli

TOL = 1e-4  # max abs logit difference allowed between our forward and HF's
SMALL = dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, context_length=16,
             intermediate_size=128, rescale_every=0)


def _need(module: str):
    if os.environ.get("CI") == "true":  # CI installs the [hf] extra: its absence is a failure
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"needs {module}: pip install -e '.[hf]'")


@pytest.fixture(scope="module")
def hf():
    torch = _need("torch")
    transformers = _need("transformers")
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    return SimpleNamespace(torch=torch, tf=transformers)


def random_hf_model(hf, seed: int = 0, **overrides):
    """A seeded RwkvForCausalLM with every tensor perturbed, in eval mode."""
    hf.torch.manual_seed(seed)
    model = hf.tf.RwkvForCausalLM(hf.tf.RwkvConfig(**{**SMALL, **overrides}))
    g = hf.torch.Generator().manual_seed(seed)
    with hf.torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * hf.torch.randn(p.shape, generator=g))
    return model.eval()


def hf_logits(hf, model, ids: np.ndarray) -> np.ndarray:
    with hf.torch.no_grad():
        return model(hf.torch.tensor(ids)).logits.float().numpy()


def our_logits(config: RWKVConfig, flat: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return RWKV(config).logits(flat, ids)


def random_ours(vocab: int = 256, seed: int = 1) -> tuple[RWKV, np.ndarray]:
    """Our rwkv, initialised and then perturbed everywhere (the init zeroes some matrices)."""
    model = RWKV(RWKVConfig(vocab_size=vocab, n_layer=2, n_embd=32, ctx_len=16, ffn_mult=3))
    rng = np.random.default_rng(seed)
    flat = model.space.zeros()
    model.init_params(flat, rng)
    for view in model.space.views(flat).values():
        view += rng.normal(0.0, 0.2, view.shape).astype(np.float32)
    return model, flat


def token_ids(vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (2, 16))


# ---------------------------------------------------------------- HF -> ours


@pytest.mark.parametrize("dtype,stored", [("float32", "F32"), ("float16", "F16"),
                                          ("bfloat16", "BF16")])
def test_hf_model_loads_with_equal_logits(hf, tmp_path, dtype, stored):
    model = random_hf_model(hf).to(getattr(hf.torch, dtype))
    model.save_pretrained(tmp_path)
    with open(tmp_path / WEIGHTS_FILE, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["rwkv.embeddings.weight"]["dtype"] == stored
    config, flat = load_hf(tmp_path)
    assert config == RWKVConfig(vocab_size=300, n_layer=2, n_embd=32, ctx_len=16, ffn_mult=4)
    assert flat.dtype == np.float32 and flat.shape == (RWKV(config).space.size,)
    ids = token_ids(300)
    reference = hf_logits(hf, model.float(), ids)  # HF on the same weights, upcast exactly
    assert np.abs(our_logits(config, flat, ids) - reference).max() <= TOL


def test_sharded_tied_and_rescaled_checkpoints(hf, tmp_path):
    ids = token_ids(300, seed=3)
    model = random_hf_model(hf, seed=2)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    config, flat = load_hf(tmp_path / "sharded")
    assert np.abs(our_logits(config, flat, ids) - hf_logits(hf, model, ids)).max() <= TOL

    tied = random_hf_model(hf, seed=4, tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied")
    assert "head.weight" not in load_file(tmp_path / "tied" / WEIGHTS_FILE)
    config, flat = load_hf(tmp_path / "tied")
    assert np.abs(our_logits(config, flat, ids) - hf_logits(hf, tied, ids)).max() <= TOL

    # rescale_every only changes HF's eval-mode arithmetic; the stored weights are unscaled,
    # equal to HF's training-mode forward (saved before any eval forward: see hf.py)
    rescaled = random_hf_model(hf, seed=5, num_hidden_layers=4, rescale_every=1)
    rescaled.save_pretrained(tmp_path / "rescaled")
    config, flat = load_hf(tmp_path / "rescaled")
    assert config.n_layer == 4
    expected = hf_logits(hf, rescaled.train(), ids)
    assert np.abs(our_logits(config, flat, ids) - expected).max() <= TOL


# ---------------------------------------------------------------- ours -> HF


def test_export_loads_in_transformers_and_generates_the_same_text(hf, tmp_path):
    model, flat = random_ours()
    out = tmp_path / "export"
    written = export_hf(model, flat, out)
    assert set(written) == {CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json", "tokenizer_config.json"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temporary left
    theirs = hf.tf.RwkvForCausalLM.from_pretrained(out).eval()
    assert theirs.config.intermediate_size == 96 and theirs.config.rescale_every == 0
    ids = token_ids(256, seed=5)
    assert np.abs(model.logits(flat, ids) - hf_logits(hf, theirs, ids)).max() <= TOL

    tokenizer = hf.tf.AutoTokenizer.from_pretrained(out)
    prompt = "Hi, é!"
    assert tokenizer.encode(prompt) == list(prompt.encode())
    assert tokenizer.decode(list(prompt.encode())) == prompt
    with hf.torch.no_grad():
        sequence = theirs.generate(hf.torch.tensor([list(b"ROMEO")]), max_new_tokens=8,
                                   do_sample=False)
    new = sequence[0, 5:].tolist()
    ours = list(generate(model, flat, b"ROMEO", 8, 0.0, np.random.default_rng(0)))
    assert len(new) == 8 and new == ours


def test_export_then_load_is_lossless(tmp_path):
    model, flat = random_ours(vocab=300)
    written = export_hf(model, flat, tmp_path / "hf")
    assert "tokenizer.json" not in written  # not a byte vocabulary, none was given
    config, back = load_hf(tmp_path / "hf")
    assert dataclasses.replace(config, ffn_mult=3) == model.config
    assert np.array_equal(back, flat)


def test_export_copies_a_given_tokenizer_and_refuses_a_full_directory(tmp_path):
    model, flat = random_ours(vocab=300)
    tok = tmp_path / "tok.json"
    tok.write_text(word_level(10))
    export_hf(model, flat, tmp_path / "a", tokenizer=tok)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == tok.read_bytes()
    with pytest.raises(HFFormatError, match="not an empty directory"):
        export_hf(model, flat, tmp_path / "a")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(HFFormatError, match="not a tokenizers tokenizer.json"):
        export_hf(model, flat, tmp_path / "b", tokenizer=tmp_path / "bad.json")
    assert not (tmp_path / "b").exists()
    (tmp_path / "big.json").write_text(word_level(301))  # ids past the embedding
    with pytest.raises(HFFormatError, match="has 301 tokens; the model's vocabulary is 300"):
        export_hf(model, flat, tmp_path / "b", tokenizer=tmp_path / "big.json")
    (tmp_path / "odd.json").write_text(json.dumps({"model": {"type": "Nope"}}))
    with pytest.raises(HFFormatError, match="not a tokenizer the tokenizers library reads"):
        export_hf(model, flat, tmp_path / "b", tokenizer=tmp_path / "odd.json")
    assert not (tmp_path / "b").exists()
    flat[5] = np.nan
    with pytest.raises(HFFormatError, match="NaN"):
        export_hf(model, flat, tmp_path / "c")


def word_level(n: int) -> str:
    """A tokenizers document of `n` word tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"w{i}": i for i in range(n - 1)} | {"[UNK]": n - 1}
    return Tokenizer(WordLevel(vocab, unk_token="[UNK]")).to_str()


# ---------------------------------------------------------------- refusals


@pytest.fixture
def exported(tmp_path) -> Path:
    model, flat = random_ours(vocab=300)
    export_hf(model, flat, tmp_path / "hf")
    return tmp_path / "hf"


def rewrite(path: Path, change) -> None:
    """Rewrite a safetensors file after `change(tensors)` edits its dict of arrays."""
    tensors = load_file(path)
    change(tensors)
    write_safetensors(path, sorted(tensors.items()), {"format": "pt"}, 2**20)


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("rwkv.blocks.1.ln2.bias"), "missing tensors: rwkv.blocks.1.ln2.bias"),
    (lambda t: t.update({"rwkv.blocks.2.ln1.bias": np.zeros(32, np.float32)}),
     "unexpected tensor rwkv.blocks.2.ln1.bias"),
    (lambda t: t.update({"head.weight": np.zeros((32, 300), np.float32)}),
     r"head.weight has shape \[32, 300\], the config needs \[300, 32\]"),
    (lambda t: t.update({"rwkv.ln_out.weight": np.zeros(32, np.int32)}),
     "rwkv.ln_out.weight is I32; readable: F32, F16, BF16"),
    (lambda t: t["rwkv.blocks.0.attention.key.weight"].__setitem__((3, 4), np.nan),
     "rwkv.blocks.0.attention.key.weight holds NaN"),
    (lambda t: t["rwkv.blocks.1.attention.time_first"].__setitem__(0, np.inf),
     "time_first holds NaN or infinite"),
])
def test_malformed_weights_are_refused(exported, change, message):
    rewrite(exported / WEIGHTS_FILE, change)
    with pytest.raises(HFFormatError, match=message):
        load_hf(exported)


@pytest.mark.parametrize("edit,message", [
    ({"model_type": "rwkv5"}, "model_type is 'rwkv5'; only RWKV-4"),
    ({"attention_hidden_size": 64}, "attention_hidden_size 64 differs from hidden_size 32"),
    ({"intermediate_size": 100}, "intermediate_size 100 is not a whole multiple"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon 1e-06"),
    ({"hidden_size": None}, "hidden_size is missing"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"vocab_size": "300"}, "vocab_size must be a positive integer"),
    ({"hidden_size": 16, "attention_hidden_size": 16, "intermediate_size": 64},
     r"shape \[300, 32\], the config needs \[300, 16\]"),
])
def test_bad_configs_are_refused_naming_the_field(exported, edit, message):
    doc = json.loads((exported / CONFIG_FILE).read_text())
    doc.update(edit)
    (exported / CONFIG_FILE).write_text(json.dumps({k: v for k, v in doc.items()
                                                     if v is not None}))
    with pytest.raises(HFFormatError, match=message):
        load_hf(exported)


def test_unreadable_directories_are_refused(tmp_path, exported):
    with pytest.raises(HFFormatError, match="no config.json"):
        load_hf(tmp_path / "nowhere")
    (exported / WEIGHTS_FILE).rename(exported / "pytorch_model.bin")
    with pytest.raises(HFFormatError, match="PyTorch pickles only"):
        load_hf(exported)
    (exported / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"head.weight": "model-1.safetensors"}}))
    with pytest.raises(HFFormatError, match="model-1.safetensors is listed but missing"):
        load_hf(exported)
    save_file({"head.weight": np.zeros((300, 32), np.float32)}, exported / "model-1.safetensors")
    with pytest.raises(HFFormatError, match="missing tensors: rwkv.embeddings.weight"):
        load_hf(exported)


def test_config_round_trip():
    config = RWKVConfig(vocab_size=1000, n_layer=3, n_embd=48, ctx_len=128, ffn_mult=2)
    assert config_from_hf(config_to_hf(config)) == config
    assert config_from_hf({**config_to_hf(config), "attention_hidden_size": None,
                           "intermediate_size": None}).ffn_mult == 4  # HF's defaults


# ---------------------------------------------------------------- the command


RWKV_TOML = ('[model]\nname = "rwkv"\n[model.rwkv]\nn_layer = 2\nn_embd = 32\nctx_len = 16\n'
             "[train]\nbatch = 4\nwarmup_samples = 8\n[eval]\nwindows = 4\nevery_seconds = 0\n")


def test_export_command_end_to_end(hf, tmp_path, small_mlp_config):
    (tmp_path / "rwkv.toml").write_text(RWKV_TOML)
    state = tmp_path / "state"
    r = run_cli("join", "--config", str(tmp_path / "rwkv.toml"), "--state-dir", str(state),
                "--steps", "2")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "hf"
    r = run_cli("export", "--format", "hf", "--checkpoint", str(state), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "tokenizer.json" in r.stdout and "from_pretrained" in r.stdout

    config, flat = load_hf(out)
    theirs = hf.tf.RwkvForCausalLM.from_pretrained(out).eval()
    ids = token_ids(256, seed=7)
    assert np.abs(our_logits(config, flat, ids) - hf_logits(hf, theirs, ids)).max() <= TOL

    again = run_cli("export", "--checkpoint", str(state), "--out", str(out))
    assert again.returncode == 2 and "not an empty directory" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    mlp_state = tmp_path / "mlp"
    assert run_cli("join", "--config", str(small_mlp_config), "--state-dir", str(mlp_state),
                   "--steps", "1").returncode == 0
    r = run_cli("export", "--checkpoint", str(mlp_state), "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "only the built-in rwkv exports" in r.stderr


def test_package_never_imports_torch_or_transformers():
    code = ("import sys, p2ptrain.models.hf, p2ptrain.cli.modelcmds, p2ptrain.cli.main;"
            "sys.exit(any(m in sys.modules for m in ('torch', 'transformers')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), timeout=60)
    assert r.returncode == 0


# ---------------------------------------------------------------- presets and --init-from


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_presets_parameter_count_equals_the_hf_models(hf, name):
    n_layer, n_embd = PRESETS[name]
    config = RWKVConfig(vocab_size=PILE_VOCAB, n_layer=n_layer, n_embd=n_embd)
    with hf.torch.device("meta"):  # shapes only: no memory for 1.5B parameters
        theirs = hf.tf.RwkvForCausalLM(hf.tf.RwkvConfig(**config_to_hf(config)))
    assert preset_params(config) == sum(p.numel() for p in theirs.parameters())
    if n_embd <= 768:
        assert RWKV(config).space.n_params == preset_params(config)


def test_config_show_names_the_preset_and_its_parameters():
    r = run_cli("config", "show", "--preset", "rwkv-169m")
    assert r.returncode == 0, r.stderr
    assert "n_layer 12, n_embd 768" in r.stdout and "169,342,464" in r.stdout, r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_init_from_an_hf_model_gives_its_logits(hf, tmp_path, dtype):
    """HF random model (its tokenizer included) -> data prepared with that tokenizer ->
    `p2ptrain join --init-from` -> the node's weights give HF's logits."""
    from tests.test_tokens import TEXT, bpe

    tokenizer = bpe(tmp_path / "tok" / "tokenizer.json", TEXT, vocab=300)
    model = random_hf_model(hf).to(getattr(hf.torch, dtype))
    hf_dir = tmp_path / "hf"
    model.save_pretrained(hf_dir)
    (hf_dir / "tokenizer.json").write_bytes(tokenizer.read_bytes())
    corpus = tmp_path / "corpus"
    assert run_cli("data", "prepare", str(REPO / "p2ptrain" / "data" / "tinyshakespeare.txt"),
                   "--tokenizer", str(hf_dir / "tokenizer.json"), "--out",
                   str(corpus)).returncode == 0
    state = tmp_path / "state"
    r = run_cli("join", "--init-from", str(hf_dir), "--data", str(corpus), "--state-dir",
                str(state), "--steps", "1", "--lr", "0", "--log-format", "json", "--batch", "1")
    assert r.returncode == 0, r.stderr
    assert '"event": "init_from"' in r.stdout
    from p2ptrain import checkpoint

    path = checkpoint.list_checkpoints(state / "checkpoints")[0]
    manifest = checkpoint.read_manifest(path)
    ours = RWKV(RWKVConfig(**{k: v for k, v in manifest.arch.items() if k != "model"}))
    flat = ours.space.zeros()
    checkpoint.load_tensors(path, checkpoint.MODEL_FILE, ours.space.views(flat))
    ids = token_ids(300, seed=11)
    reference = hf_logits(hf, model.float(), ids)
    assert np.abs(ours.logits(flat, ids) - reference).max() <= TOL


def test_init_from_refuses_data_of_another_tokenizer(hf, tmp_path):
    from tests.test_tokens import TEXT, bpe

    hf_dir = tmp_path / "hf"
    random_hf_model(hf).save_pretrained(hf_dir)
    bpe(hf_dir / "tokenizer.json", TEXT, vocab=300)
    other = bpe(tmp_path / "other.json", TEXT[::-1], vocab=300)
    corpus = tmp_path / "corpus"
    assert run_cli("data", "prepare", str(REPO / "p2ptrain" / "data" / "tinyshakespeare.txt"),
                   "--tokenizer", str(other), "--out", str(corpus)).returncode == 0
    r = run_cli("join", "--init-from", str(hf_dir), "--data", str(corpus), "--state-dir",
                str(tmp_path / "s"), "--steps", "1")
    assert r.returncode == 2 and "prepared with another tokenizer" in r.stderr, r.stderr
    r = run_cli("join", "--init-from", str(hf_dir), "--state-dir", str(tmp_path / "s2"),
                "--steps", "1")  # bytes: vocabulary 256, the model's 300
    assert r.returncode == 2 and "vocabulary of 300 tokens" in r.stderr, r.stderr


def test_a_byte_model_we_exported_initialises_a_run_on_bytes(tmp_path):
    """export -> --init-from, the README's round trip, on the built-in byte data: the export's
    byte tokenizer.json was compared by hash with the data's "bytes" and refused ("prepared
    with another tokenizer"), where `--base` of the same directory was accepted."""
    state = tmp_path / "s"
    r = run_cli("join", "--alone", "--steps", "2", "--batch", "4", "--state-dir", str(state))
    assert r.returncode == 0, r.stderr
    r = run_cli("export", "--checkpoint", str(state), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    r = run_cli("join", "--alone", "--init-from", str(tmp_path / "hf"), "--steps", "1",
                "--batch", "4", "--state-dir", str(tmp_path / "s2"), "--log-format", "json")
    assert r.returncode == 0 and '"event": "init_from"' in r.stdout, r.stderr
