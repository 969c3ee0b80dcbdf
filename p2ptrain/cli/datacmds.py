"""`p2ptrain data prepare`: tokenize text into shards a swarm trains on (data/prepare.py)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_data_parser(sub) -> None:
    """Register `data prepare` on the top-level subparsers `sub`."""
    data = sub.add_parser("data", help="prepare training data")
    data_sub = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prepare = data_sub.add_parser(
        "prepare", help="tokenize text files into token-id shards",
        description=(
            "Tokenize text files (or directories of them, read in sorted order) with a Hugging "
            "Face tokenizers tokenizer.json and write token-id shards (uint16 when the "
            "vocabulary fits, else uint32), the tokenizer and a meta.json into OUT. Train on "
            "it with `p2ptrain join --data OUT`: the model's vocabulary comes from the data, "
            "nodes must use the same tokenizer, and `sample` and `export` decode with it. The "
            "last --holdout of the tokens is held out for evaluation. Byte-level data (the "
            "default) needs none of this: --data takes text files directly."),
        epilog="Example: p2ptrain data prepare books/ --tokenizer tokenizer.json --out corpus")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help="text files or directories of text files")
    prepare.add_argument("--tokenizer", required=True, metavar="FILE",
                         help="a tokenizers tokenizer.json (e.g. from a Hugging Face model)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    prepare.add_argument("--holdout", type=float, default=0.1,
                         help="fraction of the tokens held out for evaluation (default 0.1)")


def cmd_data(args: argparse.Namespace) -> int:
    from p2ptrain.data.prepare import prepare
    from p2ptrain.data.tokens import TokenDataError
    from p2ptrain.errors import UserError

    try:
        done = prepare([Path(p).expanduser() for p in args.inputs],
                       Path(args.tokenizer).expanduser(), Path(args.out).expanduser(),
                       holdout_fraction=args.holdout)
    except TokenDataError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    print(f"prepared {done.out}: {done.train_tokens:,} training and {done.heldout_tokens:,} "
          f"held-out tokens from {done.input_bytes:,} bytes, vocabulary {done.vocab_size:,}, "
          f"{done.shards} shards; train with: p2ptrain join --data {done.out}")
    return 0
