"""What each `p2ptrain` subcommand does, once its arguments are parsed."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np

from p2ptrain import checkpoint
from p2ptrain.checkpoint.safetensors_io import SafetensorsError
from p2ptrain.cli.args import flags_of, model_params, resolve_checkpoint, resolve_config
from p2ptrain.codecs.kernels import all_finite
from p2ptrain.config import ConfigError, to_toml
from p2ptrain.data import DataError
from p2ptrain.data.tokens import TokenDataError, vocab_of
from p2ptrain.errors import UserError
from p2ptrain.identity import IdentityError
from p2ptrain.swarm import SwarmError

USER_ERRORS = (UserError, ConfigError, DataError, TokenDataError, checkpoint.CheckpointError,
               IdentityError, SafetensorsError, SwarmError)


def dispatch(args: argparse.Namespace) -> int:
    from p2ptrain.cli import swarmcmds

    if args.command == "join":
        return swarmcmds.cmd_join(args, flags_of(args))
    if args.command == "init":
        return swarmcmds.cmd_init(args, flags_of(args))
    if args.command == "status":
        return swarmcmds.cmd_status(args)
    if args.command == "checkpoint" and args.checkpoint_command == "merge":
        from p2ptrain.cli.loracmds import cmd_merge

        return cmd_merge(args)
    if args.command == "checkpoint":
        return swarmcmds.cmd_fetch(args, flags_of(args))
    if args.command == "sample":
        return cmd_sample(args)
    if args.command == "hw":
        return cmd_hw(args)
    if args.command == "bench":
        return cmd_bench(args)
    if args.command == "config":
        return cmd_config_show(args)
    if args.command == "key":
        from p2ptrain.cli.keycmds import cmd_key_rotate

        return cmd_key_rotate(args)
    if args.command == "export":
        from p2ptrain.cli.modelcmds import cmd_export

        return cmd_export(args)
    if args.command == "data":
        from p2ptrain.cli.datacmds import cmd_data

        return cmd_data(args)
    raise UserError(f"unknown command {args.command}")


def cmd_config_show(args) -> int:
    cfg = resolve_config(args)
    sys.stdout.write(to_toml(cfg))
    sys.stdout.write(model_summary(cfg))
    return 0


def model_summary(cfg) -> str:
    """Comment lines: the model this configuration trains (its shape after a preset, its
    parameters with the data's vocabulary) and every preset's size."""
    from dataclasses import fields, replace

    from p2ptrain.config import ConfigError
    from p2ptrain.data.tokens import is_prepared, open_prepared
    from p2ptrain.models import build_model, presets
    from p2ptrain.models.rwkv import RWKVConfig

    try:
        config = cfg.model_config()
    except (ConfigError, ValueError) as exc:
        return f"\n# model: {exc}\n"
    vocab, where = 256, "bytes"
    path = Path(cfg["data.path"]).expanduser() if cfg["data.path"] else None
    if path is not None and is_prepared(path):
        try:
            vocab, where = open_prepared(path).vocab_size, f"the data's, {path}"
        except TokenDataError as exc:
            return f"\n# model: the data cannot be read: {exc}\n"
    name = cfg["model.name"]
    n = build_model(name, replace(config, vocab_size=vocab)).space.n_params
    shape = ", ".join(f"{f.name} {getattr(config, f.name)}" for f in fields(config)
                      if f.name != "vocab_size")
    preset = f" (preset {cfg['model.preset']})" if cfg["model.preset"] else ""
    lines = [f"# model: {name}{preset}: {shape}: {n:,} parameters with a vocabulary of "
             f"{vocab:,} ({where})"]
    if cfg["train.mode"] == "lora" and name == "rwkv":
        from p2ptrain.models.lora import LoRAConfig, lora_sizes

        try:
            adapters, _ = lora_sizes(replace(config, vocab_size=vocab), LoRAConfig(
                cfg["lora.rank"], cfg["lora.alpha"], cfg["lora.targets"]))
            lines.append(f"#   LoRA r{cfg['lora.rank']}: {adapters:,} adapter parameters train "
                         f"and travel ({adapters / n:.2%}); the base's shape replaces this one "
                         f"when it is read")
        except ValueError as exc:
            lines.append(f"#   LoRA: {exc}")
    if cfg["model.init_from"]:
        lines.append(f"#   (the shape and vocabulary of {cfg['model.init_from']} replace these "
                     f"when it is read)")
    lines.append(f"# presets (parameters with the RWKV-4 vocabulary of {presets.PILE_VOCAB:,}):")
    for key, (n_layer, n_embd) in presets.PRESETS.items():
        count = presets.params(RWKVConfig(vocab_size=presets.PILE_VOCAB, n_layer=n_layer,
                                          n_embd=n_embd))
        lines.append(f"#   {key:10s} {count:>15,}  n_layer {n_layer}, n_embd {n_embd}")
    return "\n" + "\n".join(lines) + "\n"


def cmd_sample(args) -> int:
    from p2ptrain.cli.loracmds import model_of_checkpoint
    from p2ptrain.sample import Printable, TokenText, generate

    if args.length < 0:
        raise UserError("--length must be >= 0")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):  # nan: a traceback
        raise UserError("--temperature must be a finite number >= 0")
    path, manifest = resolve_checkpoint(Path(args.checkpoint).expanduser())
    model = model_of_checkpoint(path, manifest, args.base)
    params, meta = model_params(path, manifest, model)
    if not all_finite(params):  # (a traceback in the sampler, or NUL bytes and exit 0)
        raise UserError(f"{path.name}: its weights hold NaN or infinite values")
    if getattr(model, "mode", "full") == "lora":  # the tokenizer travels with the base
        meta = {**model.base.metadata, **meta}
    out = sys.stdout.buffer
    rng = np.random.default_rng(args.seed)
    if checkpoint.TOKENIZER_META_KEY in meta:  # a tokenized model: its tokenizer decodes
        tokenizer = tokenizer_of(meta[checkpoint.TOKENIZER_META_KEY], path)
        if (ids := vocab_of(tokenizer)) > model.vocab_size:  # they would index past the
            raise UserError(f"{path.name}: the tokenizer it carries has {ids:,} ids; the "
                            f"model's vocabulary is {model.vocab_size:,}")  # embedding
        prompt = tokenizer.encode(args.prompt, add_special_tokens=False).ids
        text = TokenText(tokenizer)
        out.write(text.feed(prompt).encode("utf-8"))
        start = (tokenizer.encode("\n", add_special_tokens=False).ids or [0])[0]
        for token in generate(model, params, prompt, args.length, args.temperature, rng,
                              start):
            out.write(text.feed([token]).encode("utf-8"))
            out.flush()
        out.write(b"\n")
        return 0
    prompt_bytes = args.prompt.encode("utf-8")
    printable = None if args.raw else Printable()

    def write(data: bytes, final: bool = False) -> None:
        out.write(data if printable is None else printable.feed(data, final).encode("utf-8"))
        out.flush()

    write(prompt_bytes)
    for byte in generate(model, params, prompt_bytes, args.length, args.temperature, rng):
        write(bytes([byte]))
    write(b"\n", final=True)
    return 0


def tokenizer_of(document: str, where: Path):
    """The `tokenizers` tokenizer a checkpoint carries (its weights' metadata)."""
    from tokenizers import Tokenizer

    from p2ptrain.data.tokens import plain

    try:
        return plain(Tokenizer.from_str(document))
    except Exception as exc:  # the library raises its own exception types
        raise UserError(f"{where.name}: the tokenizer it carries does not load: "
                        f"{str(exc)[:120]}") from None


def cmd_hw(args) -> int:
    from p2ptrain import memplan
    from p2ptrain.calibration import calibrate
    from p2ptrain.hw import explain_batch
    from p2ptrain.models import build_model

    cfg = resolve_config(args)
    model = build_model(cfg["model.name"], cfg.model_config())
    found = calibrate(Path(cfg["node.state_dir"]).expanduser())
    for warning in found.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    hw = found.hardware
    choice = explain_batch(hw, model.flops_per_token() * model.ctx_len,
                           model.activation_bytes_per_sample(),
                           cfg["train.target_step_seconds"])
    largest = memplan.largest_here(hw.memory_bytes)
    if args.json:
        print(json.dumps({**hw.as_dict(), "model": model.name, "batch": choice.batch,
                          "accum": choice.accum, "matmul": found.as_dict(),
                          "choice": choice.as_dict(), "largest_trainable": largest}))
        return 0
    limits = []
    if hw.cgroup_cpu_limit is not None:
        limits.append(f"cgroup cpu.max {hw.cgroup_cpu_limit:g} cores")
    if hw.cgroup_memory_limit is not None:
        limits.append(f"cgroup memory.max {hw.cgroup_memory_limit / 2**30:.1f} GiB")
    print(f"device class   {hw.device_class}")
    print(f"architecture   {hw.arch}")
    print(f"cores          {hw.cpus:g} usable of {hw.cpus_host}")
    print(f"memory         {hw.memory_bytes / 2**30:.1f} GiB usable")
    print(f"limits         {', '.join(limits) if limits else 'none (not in a limited cgroup)'}")
    for k, line in enumerate(found.describe()):
        print(f"{'' if k else 'matmul':<14} {line}")
    print(f"batch          {choice.batch} for {model.name}" + (
        f" ({choice.accum} micro-batches)" if choice.accum > 1 else ""))
    for k, line in enumerate(choice.explain()):
        print(f"{'' if k else 'why':<14} {line}")
    print(f"model size     {memplan.describe_largest(largest)}")
    return 0


def cmd_bench(args) -> int:
    if args.target == "codecs":
        from p2ptrain.codecs.bench import format_table, run_codec_bench

        if (args.size is not None and args.size < 1) or args.repeats < 1:
            raise UserError("--size and --repeats must be >= 1")
        if not args.json:
            print(f"measuring codecs on {args.size or 100_000_000:,} float32 values ...",
                  file=sys.stderr, flush=True)
        result = run_codec_bench(args.size or 100_000_000, repeats=args.repeats)
        print(json.dumps(result) if args.json else format_table(result))
        return 0
    from p2ptrain.bench import run_model_bench

    cfg = resolve_config(args)
    if args.size is not None and args.size < 1:
        raise UserError("--size must be >= 1")
    progress = None if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
    doc = run_model_bench(cfg, batch=args.size or 32, seconds=args.seconds, progress=progress)
    if args.json:
        print(json.dumps(doc))
    else:
        threads = os.environ.get("OPENBLAS_NUM_THREADS", "default")
        print(f"model            {doc['model']} ({doc['params'] / 1e6:.2f}M parameters, "
              f"batch {doc['batch']} x {doc['ctx_len']} tokens)")
        print(f"training         {doc['tokens_per_s']:,.0f} tokens/s "
              f"({doc['step_s'] * 1000:.0f} ms/step)")
        print(f"model FLOP/s     {doc['model_gflops']:.1f} GFLOP/s "
              f"({doc['flops_per_token'] / 1e6:.2f} MFLOP/token, formula in docs/BENCHMARKS.md)")
        print(f"matmul FLOP/s    {doc['matmul_gflops']:.1f} GFLOP/s (float32 1024x1024, "
              f"BLAS threads: {threads})")
        print(f"ratio            {doc['ratio']:.2f} (goal >= 0.3)")
    return 0
