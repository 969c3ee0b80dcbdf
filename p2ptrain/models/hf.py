"""The built-in `rwkv` in Hugging Face's format: `transformers.RwkvForCausalLM` directories.

Our `rwkv` is the RWKV-4 architecture that RwkvForCausalLM implements, so a directory of
`config.json` + `model.safetensors` converts both ways without loss: tensors are renamed,
our (in, out) matrices become Linear weights (out, in), and the token-shift mixes gain two
leading unit axes. The exponent conventions already agree (decay w = -exp(time_decay), bonus
u = time_first), and our LN0 on the embedding table is HF's `blocks.0.pre_ln` on the
embedded tokens. What our model cannot represent is refused by name, never approximated:
a key/value width (`attention_hidden_size`) other than `hidden_size`, a channel-mix width
(`intermediate_size`) that is not a whole multiple of it, or a LayerNorm epsilon other than
1e-5 (HF's `ln_out` uses 1e-5 whatever the config says).

`rescale_every` is an inference trick of HF's eval mode (hidden state halved every N blocks,
output weights divided to match); the weights on disk are unscaled, so imports ignore it
and exports write 0, which makes HF's logits equal ours.

Reading trusts nothing: every tensor's name, shape and dtype (F32, F16 or BF16) is checked
against the layout before a byte is read, and every value must be finite. Tensors are
widened one at a time straight into the one flat float32 buffer. This file imports no torch
and no transformers; it never draws random numbers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from p2ptrain.checkpoint.safetensors_io import (
    SafetensorsError,
    read_header,
    read_into,
    storage_dtype,
    write_safetensors,
)
from p2ptrain.codecs.kernels import all_finite
from p2ptrain.fsutil import fsync_dir
from p2ptrain.models.frozen import widen
from p2ptrain.models.rwkv import LN_EPS, RWKV, RWKVConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
READABLE_DTYPES = ("F32", "F16", "BF16")
WRITE_CHUNK = 64 * 2**20  # the writer hashes in chunks; an export does not use the digest

# (our name, HF name, transposed) inside block i: "blocks.{i}." + ours, "rwkv.blocks.{i}." + HF
BLOCK_TENSORS = (
    ("ln1.weight", "ln1.weight", False),
    ("ln1.bias", "ln1.bias", False),
    ("ln2.weight", "ln2.weight", False),
    ("ln2.bias", "ln2.bias", False),
    ("att.time_decay", "attention.time_decay", False),
    ("att.time_first", "attention.time_first", False),
    ("att.time_mix_k", "attention.time_mix_key", False),
    ("att.time_mix_v", "attention.time_mix_value", False),
    ("att.time_mix_r", "attention.time_mix_receptance", False),
    ("att.key", "attention.key.weight", True),
    ("att.value", "attention.value.weight", True),
    ("att.receptance", "attention.receptance.weight", True),
    ("att.output", "attention.output.weight", True),
    ("ffn.time_mix_k", "feed_forward.time_mix_key", False),
    ("ffn.time_mix_r", "feed_forward.time_mix_receptance", False),
    ("ffn.key", "feed_forward.key.weight", True),
    ("ffn.receptance", "feed_forward.receptance.weight", True),
    ("ffn.value", "feed_forward.value.weight", True),
)
OUTER_TENSORS = (
    ("emb", "rwkv.embeddings.weight", False),
    ("ln0.weight", "rwkv.blocks.0.pre_ln.weight", False),
    ("ln0.bias", "rwkv.blocks.0.pre_ln.bias", False),
    ("ln_out.weight", "rwkv.ln_out.weight", False),
    ("ln_out.bias", "rwkv.ln_out.bias", False),
    ("head", "head.weight", True),
)
HEAD = "head.weight"


class HFFormatError(ValueError):
    """A Hugging Face directory or config that our `rwkv` cannot take; says which field or
    tensor, and why."""


@dataclass(frozen=True, slots=True)
class TensorPair:
    """One tensor under both names."""

    ours: str  # name in our ParamSpace, e.g. "blocks.0.att.key"
    theirs: str  # name in HF's state dict, e.g. "rwkv.blocks.0.attention.key.weight"
    transposed: bool  # ours is (in, out), HF's nn.Linear weight is (out, in)
    hf_shape: tuple[int, ...]  # shape in HF's state dict


def tensor_pairs(model: RWKV) -> list[TensorPair]:
    """Every parameter of `model` with its HF name and shape, in our layout's order."""
    names = {ours: (theirs, t) for ours, theirs, t in OUTER_TENSORS}
    for i in range(model.config.n_layer):
        for ours, theirs, t in BLOCK_TENSORS:
            names[f"blocks.{i}.{ours}"] = (f"rwkv.blocks.{i}.{theirs}", t)
    pairs = []
    for slot in model.space:
        theirs, transposed = names[slot.name]
        if transposed:
            shape = slot.shape[::-1]
        elif ".time_mix_" in slot.name:
            shape = (1, 1, *slot.shape)  # HF broadcasts them over (batch, time, channel)
        else:
            shape = slot.shape
        pairs.append(TensorPair(slot.name, theirs, transposed, shape))
    if len(pairs) != len(names):
        raise AssertionError("the HF name table and the rwkv layout disagree")
    return pairs


# ---------------------------------------------------------------- configs


def config_to_hf(config: RWKVConfig) -> dict:
    """The config.json of RwkvForCausalLM for our `config` (`wkv_chunk` is a compute setting
    of ours and has no counterpart; the byte models have no end-of-text token)."""
    C = config.n_embd
    return {
        "architectures": ["RwkvForCausalLM"],
        "model_type": "rwkv",
        "vocab_size": config.vocab_size,
        "context_length": config.ctx_len,
        "hidden_size": C,
        "num_hidden_layers": config.n_layer,
        "attention_hidden_size": C,
        "intermediate_size": config.ffn_mult * C,
        "layer_norm_epsilon": LN_EPS,
        "rescale_every": 0,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def _positive_int(hf: dict, key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise HFFormatError(f"config.json: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFFormatError(f"config.json: {key} must be a positive integer, got {value!r}")
    return value


def config_from_hf(hf: dict, wkv_chunk: int = RWKVConfig.wkv_chunk) -> RWKVConfig:
    """Our RWKVConfig for an HF RWKV config.json document; HFFormatError names the field our
    model cannot represent. `ctx_len` becomes HF's context_length (change it freely: it does
    not alter the parameters); keys HF would default are defaulted as RwkvConfig does."""
    if not isinstance(hf, dict):
        raise HFFormatError("config.json is not a JSON object")
    if hf.get("model_type") != "rwkv":
        raise HFFormatError(
            f"config.json: model_type is {hf.get('model_type')!r}; only RWKV-4 ('rwkv', "
            f"transformers' RwkvForCausalLM) has our layout")
    C = _positive_int(hf, "hidden_size")
    n_layer = _positive_int(hf, "num_hidden_layers")
    vocab = _positive_int(hf, "vocab_size")
    ctx = _positive_int(hf, "context_length", 1024)
    att = hf.get("attention_hidden_size")
    if att is not None and att != C:
        raise HFFormatError(f"config.json: attention_hidden_size {att!r} differs from "
                            f"hidden_size {C}; our rwkv's time-mix is C x C")
    ffn = hf.get("intermediate_size")
    ffn = 4 * C if ffn is None else ffn
    if isinstance(ffn, bool) or not isinstance(ffn, int) or ffn < C or ffn % C:
        raise HFFormatError(f"config.json: intermediate_size {ffn!r} is not a whole multiple "
                            f"of hidden_size {C}; our rwkv's channel-mix width is ffn_mult x C")
    eps = hf.get("layer_norm_epsilon", 1e-5)
    if (isinstance(eps, bool) or not isinstance(eps, int | float)
            or not math.isclose(eps, LN_EPS, rel_tol=1e-6)):
        raise HFFormatError(f"config.json: layer_norm_epsilon {eps!r}; our rwkv uses {LN_EPS}")
    if not isinstance(hf.get("tie_word_embeddings", False), bool):
        raise HFFormatError("config.json: tie_word_embeddings must be true or false")
    try:
        config = RWKVConfig(vocab_size=vocab, n_layer=n_layer, n_embd=C, ctx_len=ctx,
                            ffn_mult=ffn // C, wkv_chunk=wkv_chunk)
        RWKV(config)
    except ValueError as exc:
        raise HFFormatError(f"config.json: {exc}") from None
    return config


def read_config(hf_dir: str | os.PathLike) -> dict:
    """The config.json document of an HF model directory."""
    path = Path(hf_dir) / CONFIG_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFFormatError(f"{hf_dir}: no {CONFIG_FILE} (not a Hugging Face model "
                            f"directory)") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise HFFormatError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None


def _vocab_size(tok_doc: dict, where) -> int:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(json.dumps(tok_doc)).get_vocab_size()
    except Exception as exc:  # the library raises plain Exceptions on a bad document
        raise HFFormatError(f"tokenizer {where}: not a tokenizer the tokenizers library "
                            f"reads ({exc})") from None


# ---------------------------------------------------------------- import


def weight_files(hf_dir: Path) -> dict[str, list[str]]:
    """File name -> the tensor names the directory says it holds: one model.safetensors
    (names from its header: an empty list), or the shards model.safetensors.index.json lists."""
    index = hf_dir / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise HFFormatError(f"{index}: unreadable ({exc})") from None
        if not isinstance(weight_map, dict) or not all(
                isinstance(v, str) and Path(v).name == v for v in weight_map.values()):
            raise HFFormatError(f"{index}: weight_map must map names to file names in "
                                f"the directory")
        files: dict[str, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        return files
    if (hf_dir / WEIGHTS_FILE).exists():
        return {WEIGHTS_FILE: []}  # names come from its header
    if any((hf_dir / f).exists() for f in ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        raise HFFormatError(
            f"{hf_dir} holds PyTorch pickles only; convert them once with transformers "
            f"(from_pretrained, then save_pretrained, which writes safetensors)")
    raise HFFormatError(f"{hf_dir}: no {WEIGHTS_FILE} or {INDEX_FILE}")


def _check_entry(file: str, name: str, entry: dict, pair: TensorPair) -> None:
    if entry["dtype"] not in READABLE_DTYPES:
        raise HFFormatError(f"{file}: tensor {name} is {entry['dtype']}; "
                            f"readable: {', '.join(READABLE_DTYPES)}")
    if tuple(entry["shape"]) != pair.hf_shape:
        raise HFFormatError(f"{file}: tensor {name} has shape {entry['shape']}, "
                            f"the config needs {list(pair.hf_shape)}")


def load_hf(hf_dir: str | os.PathLike, wkv_chunk: int = RWKVConfig.wkv_chunk,
            into: np.ndarray | None = None) -> tuple[RWKVConfig, np.ndarray]:
    """The config and the flat float32 parameters (our ParamSpace) of an HF RWKV-4 directory
    (read into `into`, a flat buffer of that space, when given).

    Every tensor's name, shape and dtype is checked in every file before any data is read;
    missing, unknown, duplicated and non-finite tensors are refused (HFFormatError). Memory:
    the flat buffer plus one tensor in its stored dtype at a time."""
    hf_dir = Path(hf_dir)
    raw_config = read_config(hf_dir)
    config = config_from_hf(raw_config, wkv_chunk)
    tied = raw_config.get("tie_word_embeddings", False)
    model = RWKV(config)
    by_hf_name = {p.theirs: p for p in tensor_pairs(model)}

    plan: list[tuple[str, dict, int, list[str]]] = []  # (file, header, data start, names)
    seen: dict[str, str] = {}
    for file, listed in weight_files(hf_dir).items():
        try:
            with open(hf_dir / file, "rb") as f:
                header, start = read_header(f)
        except FileNotFoundError:
            raise HFFormatError(f"{hf_dir}: {file} is listed but missing") from None
        except (OSError, SafetensorsError) as exc:
            raise HFFormatError(f"{hf_dir / file}: {exc}") from None
        names = sorted(k for k in header if k != "__metadata__")
        if listed and sorted(listed) != names:
            raise HFFormatError(f"{hf_dir / file} does not hold the tensors "
                                f"{INDEX_FILE} lists for it")
        for name in names:
            if name not in by_hf_name:
                raise HFFormatError(f"{file}: unexpected tensor {name} (not part of an RWKV-4 "
                                    f"model of this config)")
            if name in seen:
                raise HFFormatError(f"tensor {name} is in both {seen[name]} and {file}")
            seen[name] = file
            _check_entry(file, name, header[name], by_hf_name[name])
        plan.append((file, header, start, names))
    missing = [n for n in by_hf_name if n not in seen and not (n == HEAD and tied)]
    if missing:
        raise HFFormatError(f"missing tensors: {', '.join(missing[:5])}"
                            + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))

    if into is not None and (into.dtype != np.float32 or into.shape != (model.space.size,)):
        raise ValueError(f"`into` must be a float32 vector of {model.space.size} values")
    flat = into if into is not None else model.space.zeros(np.float32)
    views = model.space.views(flat)
    for file, header, start, names in plan:
        with open(hf_dir / file, "rb") as f:
            for name in names:
                pair, dtype = by_hf_name[name], header[name]["dtype"]
                dest = views[pair.ours]
                direct = dtype == "F32" and not pair.transposed  # straight into the buffer
                raw = (dest.reshape(pair.hf_shape) if direct
                       else np.empty(pair.hf_shape, storage_dtype(dtype)))
                try:
                    read_into(f, header, start, {name: raw})
                except SafetensorsError as exc:
                    raise HFFormatError(f"{file}: {exc}") from None
                if not direct:
                    widen(raw.T if pair.transposed else raw.reshape(dest.shape), dtype, dest)
                if not np.isfinite(dest).all():
                    raise HFFormatError(f"{file}: tensor {name} holds NaN or infinite values")
    if HEAD not in seen:  # tied: the head is the embedding table
        views["head"][...] = views["emb"].T
    return config, flat


# ---------------------------------------------------------------- export


def is_byte_tokenizer(raw: bytes, vocab_size: int) -> bool:
    """Whether a tokenizer.json's bytes are `byte_tokenizer()`'s (a byte model we exported:
    it trains on bytes, as the data without a tokenizer does)."""
    try:
        return vocab_size == 256 and json.loads(raw) == byte_tokenizer()
    except (ValueError, RecursionError):
        return False


def byte_tokenizer() -> dict:
    """A `tokenizers` document for byte-level models: token id b is the byte b, no merges
    (bytes are spelled with the usual byte-level alphabet of printable characters)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {alphabet[b]: b for b in range(256)}, "merges": []},
    }


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def export_tensors(model: RWKV, flat: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, view of `flat` in HF's shape) for every tensor; transposed matrices are
    non-contiguous views, copied one at a time by the writer."""
    views = model.space.views(flat)
    for pair in tensor_pairs(model):
        v = views[pair.ours]
        yield pair.theirs, (v.T if pair.transposed else v.reshape(pair.hf_shape))


def export_hf(model: RWKV, flat: np.ndarray, out_dir: str | os.PathLike,
              tokenizer: str | os.PathLike | None = None,
              tokenizer_document: str | None = None) -> list[str]:
    """Write `flat` (our layout, float32) as an RwkvForCausalLM directory `out_dir`, which
    must not exist or be empty. Returns the file names written.

    The tokenizer: `tokenizer` (a tokenizer.json) is copied; else `tokenizer_document` (the
    one a tokenized checkpoint carries) is written; else a byte model (vocab 256) gets the
    byte-level tokenizer; else none is written. The directory appears whole or not
    at all: written into a temporary sibling, fsynced, renamed, the parent fsynced."""
    if not isinstance(model, RWKV):
        raise HFFormatError(f"only the built-in rwkv exports to Hugging Face format, "
                            f"not {getattr(model, 'name', model)!r}")
    model.space.check_buffer(flat)
    if flat.dtype != np.float32:
        raise HFFormatError(f"parameters must be float32, got {flat.dtype}")
    if not all_finite(flat):  # np.isfinite(flat) held a bool copy: 1 byte a parameter more
        raise HFFormatError("the parameters hold NaN or infinite values")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HFFormatError(f"{out} exists and is not an empty directory")
    tok_doc = None
    if tokenizer is not None:
        try:
            tok_doc = json.loads(Path(tokenizer).read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            raise HFFormatError(f"tokenizer {tokenizer}: unreadable ({exc})") from None
        if not isinstance(tok_doc, dict) or "model" not in tok_doc:
            raise HFFormatError(f"tokenizer {tokenizer}: not a tokenizers tokenizer.json")
        n = _vocab_size(tok_doc, tokenizer)
        if n > model.vocab_size:  # its ids would index past the embedding
            raise HFFormatError(f"tokenizer {tokenizer} has {n:,} tokens; the model's "
                                f"vocabulary is {model.vocab_size:,}")
    elif tokenizer_document is not None:
        try:
            tok_doc = json.loads(tokenizer_document)
        except (ValueError, RecursionError) as exc:
            raise HFFormatError(f"the checkpoint's tokenizer is unreadable ({exc})") from None
        if not isinstance(tok_doc, dict) or "model" not in tok_doc:
            raise HFFormatError("the checkpoint's tokenizer is not a tokenizers document")
        n = _vocab_size(tok_doc, "the checkpoint's tokenizer")
        if n > model.vocab_size:  # as for --tokenizer: its ids would index past the embedding
            raise HFFormatError(f"the checkpoint's tokenizer has {n:,} tokens; the model's "
                                f"vocabulary is {model.vocab_size:,}")
    elif model.vocab_size == 256:
        tok_doc = byte_tokenizer()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-hf-{out.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    written = [CONFIG_FILE, WEIGHTS_FILE]
    try:
        _write_durably(tmp / CONFIG_FILE, json.dumps(config_to_hf(model.config), indent=2)
                       .encode())
        write_safetensors(tmp / WEIGHTS_FILE, export_tensors(model, flat), {"format": "pt"},
                          WRITE_CHUNK)
        if tok_doc is not None:
            if tokenizer is not None:
                shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
                with open(tmp / TOKENIZER_FILE, "rb+") as f:
                    os.fsync(f.fileno())
            else:
                _write_durably(tmp / TOKENIZER_FILE, json.dumps(tok_doc).encode())
            # no model_max_length: an RNN has none (ctx_len is only our training window)
            _write_durably(tmp / TOKENIZER_CONFIG_FILE, json.dumps(
                {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2).encode())
            written += [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE]
        fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written
