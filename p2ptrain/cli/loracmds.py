"""LoRA on the command line: `p2ptrain checkpoint merge` (base + adapters -> an ordinary full
checkpoint), and finding the base of a LoRA checkpoint for `sample` and `export`.

A LoRA checkpoint holds the adapters and names its base by id; the base is looked for in
--base (a base directory, or a directory of bases), beside the checkpoint (<state dir>/bases)
and in ~/.p2ptrain/bases.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
from pathlib import Path

MERGE_ROWS = 1024  # rows of a matrix a merge adds its adapters' product to at a time
BASE_HELP = ("a LoRA checkpoint's base: its base directory, or a directory of bases (default: "
             "<state dir>/bases beside the checkpoint, then ~/.p2ptrain/bases)")


def add_merge_parser(ckpt_sub) -> None:
    merge = ckpt_sub.add_parser(
        "merge", help="merge a LoRA checkpoint's adapters into its base",
        description=(
            "Write base + alpha/rank * A @ B of every adapted matrix as an ordinary full rwkv "
            "checkpoint (float32 weights, the base's tokenizer, the adapters' step and sample "
            "count, no optimiser state: for sample, export --format hf, or a base for the "
            "next LoRA run; not for resuming). One tensor is in memory at a time. OUT must not "
            "exist; it appears complete or not at all."),
        epilog="Example: p2ptrain checkpoint merge --adapters ~/.p2ptrain --out merged && "
               "p2ptrain export --format hf --checkpoint merged --out merged-hf")
    merge.add_argument("--adapters", required=True, metavar="PATH",
                       help="a LoRA checkpoint directory, or a state directory (its newest)")
    merge.add_argument("--base", default=None, metavar="PATH", help=BASE_HELP)
    merge.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to "
                       "create")


def model_of_checkpoint(path: Path, manifest, base: str | None):
    """The model of checkpoint `path`; a LoRA one on its base (UserError: where it looked)."""
    from p2ptrain.errors import UserError
    from p2ptrain.fsutil import describe_os_error
    from p2ptrain.lora.basefile import BaseError
    from p2ptrain.lora.setup import BaseMissing, bases_root, model_of_arch

    lora = isinstance(manifest.arch, dict) and "lora" in manifest.arch
    if base is not None and not lora:
        raise UserError(f"--base is for LoRA checkpoints; {path.name} holds a full model")
    if base is not None and not Path(base).expanduser().is_dir():
        raise UserError(f"--base {base}: no such directory")
    roots = [] if base is None else [Path(base).expanduser()]
    roots += [path.parent.parent / "bases", bases_root("~/.p2ptrain")]
    try:
        return model_of_arch(manifest.arch, roots)
    except BaseMissing as exc:
        raise UserError(f"{path.name} holds LoRA adapters of base {exc.base_id}, which is not "
                        f"in {', '.join(str(r) for r in roots)}; pass --base DIR") from None
    except (BaseError, ValueError) as exc:
        raise UserError(f"{path.name}: {exc}") from None
    except OSError as exc:  # the base's file unreadable (a failing card)
        raise UserError(f"{path.name}: its base: {describe_os_error(exc)}") from None


def cmd_merge(args: argparse.Namespace) -> int:
    import numpy as np
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from p2ptrain import checkpoint
    from p2ptrain.checkpoint.safetensors_io import Deferred
    from p2ptrain.cli.args import model_params, resolve_checkpoint
    from p2ptrain.errors import UserError
    from p2ptrain.fsutil import describe_os_error, fsync_dir
    from p2ptrain.identity import Identity, node_id_of
    from p2ptrain.models import fingerprint
    from p2ptrain.models.rwkv import RWKV

    path, manifest = resolve_checkpoint(Path(args.adapters).expanduser())
    model = model_of_checkpoint(path, manifest, args.base)
    if getattr(model, "mode", "full") != "lora":
        raise UserError(f"{path.name} is a full model's checkpoint: nothing to merge")
    out = Path(args.out).expanduser()
    if out.exists():
        raise UserError(f"{out} exists; merge writes a new checkpoint directory")
    adapters, _ = model_params(path, manifest, model)
    if not np.isfinite(adapters).all():
        raise UserError(f"{path.name}: the adapters hold NaN or infinite values")
    full = model.full_space
    ap = model.space.views(adapters)

    def merged(name: str):
        def make():
            w = model.base.widened(name)
            if name in model.adapted:  # by rows: no product the size of w beside it
                a, b = model.scale * ap[name + ".lora_a"], ap[name + ".lora_b"]
                for lo in range(0, w.shape[0], MERGE_ROWS):
                    rows = w[lo:lo + MERGE_ROWS]
                    rows += a[lo:lo + MERGE_ROWS] @ b
                    if not np.isfinite(rows).all():
                        raise UserError(f"merging {name} overflows float32")
            return w
        return make

    tensors = [(s.name, Deferred("F32", s.shape, merged(s.name))) for s in full]
    tok_json = model.base.metadata.get(checkpoint.TOKENIZER_META_KEY)
    tok_id = "bytes" if tok_json is None else hashlib.sha256(tok_json.encode()).hexdigest()[:16]
    plain = RWKV(model.config)
    snap = checkpoint.Snapshot(
        step=manifest.step, term=manifest.term, swarm_count=dict(manifest.swarm_count),
        fingerprint=fingerprint(plain, tok_id), arch=plain.arch(), model_tensors=tensors,
        state_tensors=[],
        model_meta={} if tok_json is None else {checkpoint.TOKENIZER_META_KEY: tok_json},
        state_meta={"step": manifest.step, "samples": 0, "adam_t": 0, "node_id": "",
                    "merged_from": path.name, "base": model.base_id,
                    "data": {"epoch": 0, "index": 0}})
    key = Ed25519PrivateKey.generate()  # the signature only seals the files: nobody's run
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    signer = Identity(key, raw, node_id_of(raw), 0)
    tmp_root = out.parent / f".tmp-merge-{out.name}-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        written = checkpoint.save(tmp_root, snap, signer, keep=1)
        os.rename(written, out)
        fsync_dir(out.parent)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {describe_os_error(exc)}") from None
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    print(f"merged {path} (LoRA r{model.lora.rank} on base {model.base_id}, step "
          f"{manifest.step}) into {out}: {full.n_params:,} parameters, float32")
    return 0
