"""`p2ptrain export`: taking a trained model out of p2ptrain into another ecosystem's format.

The parser is built here and registered by cli/main.py; the work happens in models/hf.py.
Nothing heavy is imported until the command runs, so `p2ptrain --help` stays quick. Problems
a user can fix are raised as UserError (one line, exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

FORMATS = ("hf",)


def add_export_parser(sub) -> None:
    """Register `export` on the top-level subparsers `sub`."""
    export = sub.add_parser(
        "export", help="write a checkpoint's model in another format (Hugging Face)",
        description=(
            "Write the model of a checkpoint directory (or a state directory: its newest "
            "valid checkpoint) as a Hugging Face transformers model directory: config.json, "
            "model.safetensors (float32) and a tokenizer, which load with "
            "RwkvForCausalLM.from_pretrained(OUT) / AutoTokenizer.from_pretrained(OUT) and "
            "generate(). Only the built-in rwkv model exports (it is the RWKV-4 architecture "
            "of RwkvForCausalLM; logits agree to float32 precision). The tokenizer is "
            "--tokenizer if given, else the one a model trained on prepared data carries, "
            "else the byte-level one (token id = byte) for 256-token models. OUT must not "
            "exist or be empty; it appears complete or not at all."),
        epilog="Example: p2ptrain export --format hf --checkpoint ~/.p2ptrain --out rwkv-hf")
    export.add_argument("--format", choices=FORMATS, default="hf",
                        help="output format: hf = Hugging Face transformers (default)")
    export.add_argument("--checkpoint", required=True, metavar="PATH",
                        help="a checkpoint directory, or a state directory holding checkpoints")
    export.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    export.add_argument("--tokenizer", default=None, metavar="FILE",
                        help="a tokenizers tokenizer.json to ship with the model (needed for "
                        "models whose vocabulary is not bytes)")


def cmd_export(args: argparse.Namespace) -> int:
    from p2ptrain import checkpoint
    from p2ptrain.cli.args import model_params, resolve_checkpoint
    from p2ptrain.errors import UserError
    from p2ptrain.fsutil import describe_os_error
    from p2ptrain.models import model_from_arch
    from p2ptrain.models.hf import TOKENIZER_FILE, HFFormatError, export_hf
    from p2ptrain.models.rwkv import RWKV

    path, manifest = resolve_checkpoint(Path(args.checkpoint).expanduser())
    try:
        model = model_from_arch(manifest.arch)
    except ValueError as exc:
        if isinstance(manifest.arch, dict) and "lora" in manifest.arch:
            raise UserError(f"{path.name} holds LoRA adapters: merge them into their base "
                            f"first (p2ptrain checkpoint merge --adapters {args.checkpoint} "
                            f"--out MERGED), then export MERGED") from None
        raise UserError(f"{path.name}: {exc}") from None
    if not isinstance(model, RWKV):
        raise UserError(f"{path.name} holds the {model.name!r} model; only the built-in rwkv "
                        f"exports to Hugging Face format")
    params, meta = model_params(path, manifest, model)
    out = Path(args.out).expanduser()
    try:
        written = export_hf(model, params, out, tokenizer=args.tokenizer,
                            tokenizer_document=meta.get(checkpoint.TOKENIZER_META_KEY))
    except HFFormatError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot write {out}: {describe_os_error(exc)}") from None
    print(f"exported {path} (step {manifest.step}, {model.space.n_params:,} parameters) "
          f"to {out}: {', '.join(written)}")
    if TOKENIZER_FILE not in written:
        print(f"note: no tokenizer written (vocabulary of {model.vocab_size} tokens is not "
              f"bytes); pass --tokenizer FILE to include one", file=sys.stderr)
    print(f"load it with: RwkvForCausalLM.from_pretrained({str(out)!r})")
    return 0
