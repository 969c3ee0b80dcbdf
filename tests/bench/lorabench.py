"""LoRA mode against full training at one shape: peak memory, seconds per step, averaging bytes.

    python -m tests.bench.lorabench --shape 1b3 [--shape 1b5 --shape default] [--base-dir DIR]
        [--steps 4] [--full auto|measure|model] [--profile]

Shapes (ctx_len 64): `1b3` 24 x 2048 at vocabulary 256 (1.31B parameters, a 2.62 GB bf16
base), `1b5` 24 x 2048 at vocabulary 50277 (the published RWKV-4 1B5), `default` the built-in
RWKVConfig(), `169m` the rwkv-169m preset at vocabulary 50277, or any `LxC[:V]`.

For each shape:
1. a random bf16 base (fresh initialisation) is written by a separate process (its float32
   buffer is not counted anywhere), into --base-dir or a temporary directory;
2. a child process under `/usr/bin/time -v` builds the LoRA model on it (rank 16, alpha 32,
   default targets), and runs --steps training steps at batch 1, context 64: loss_and_grad on
   the adapters, global-norm clipping at 1.0, AdamW over the adapter buffer (as
   p2ptrain/learner.py does). It reports the median seconds of the steps after the first,
   and the peak RSS (`Maximum resident set size`, 10^9 bytes = GB) with its parts (mapped
   file pages vs anonymous memory, from /proc/self/status) and the time spent widening the
   base (--profile: the whole step broken down by function);
3. bytes of one averaging exchange (one side's snapshot as it travels: messages with their
   headers) of the adapter vector and of the full model's, as dense fp32 and as the subset
   plan (gossip.averaging = subset_fp16: a seeded tenth in fp16; `auto`, the default, takes
   it for full training and averages every adapter in fp16 in LoRA mode);
4. full training of the same shape (float32 weights, gradient, AdamW's moments; the same
   loop) measured the same way where memplan's prediction fits in the machine's available
   memory with room to spare (--full auto), else memplan's figure.
This file only measures: it changes nothing in the package.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GB = 10**9
GIB = 2**30
RANK, ALPHA = 16, 32.0
CTX = 64
FULL_MARGIN = 2 * GIB  # full training is measured only with this much memory left over
SHAPES = {  # name -> (n_layer, n_embd, vocab_size); None: the built-in default
    "1b3": (24, 2048, 256),
    "1b5": (24, 2048, 50277),
    "169m": (12, 768, 50277),
    "default": None,
}


def shape_config(spec: str):
    """The RWKVConfig a --shape names, at context CTX."""
    from p2ptrain.models.rwkv import RWKVConfig

    if spec in SHAPES:
        dims = SHAPES[spec]
        config = RWKVConfig() if dims is None else RWKVConfig(
            n_layer=dims[0], n_embd=dims[1], vocab_size=dims[2])
    else:
        m = re.fullmatch(r"(\d+)x(\d+)(?::(\d+))?", spec)
        if not m:
            raise SystemExit(f"unknown shape {spec!r}: {', '.join(SHAPES)} or LxC[:V]")
        config = RWKVConfig(n_layer=int(m[1]), n_embd=int(m[2]), vocab_size=int(m[3] or 256))
    return replace(config, ctx_len=CTX)


# ---------------------------------------------------------------- children


def child_base(spec: str, out_root: str) -> dict:
    """Write a fresh bf16 base of `spec` (in its own process: the float32 buffer dies here)."""
    from p2ptrain.lora.basefile import base_from_init

    base = base_from_init(shape_config(spec), 0, Path(out_root), "bf16")
    return {"path": str(base.path), "id": base.id, "size": base.size}


def proc_status() -> dict[str, int]:
    """This process's memory figures from /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def train_loop(model, steps: int, seed: int = 0) -> dict:
    """`steps` training steps of `model` at batch 1: gradient, clip, AdamW (learner.py's
    apply_gradient). Seconds of each step, losses, and the buffers' bytes."""
    import numpy as np

    from p2ptrain.optim import AdamW, clip_global_norm

    rng = np.random.default_rng(seed)
    params = model.space.zeros()
    model.init_params(params, rng)
    grad = model.space.zeros()
    opt = AdamW(model.space)
    dtype = np.uint8 if model.vocab_size <= 256 else np.int32
    times, losses = [], []
    for _ in range(steps):
        tokens = rng.integers(0, model.vocab_size, (1, model.ctx_len + 1)).astype(dtype)
        t0 = time.perf_counter()
        loss = model.loss_and_grad(params, tokens, grad)
        norm = clip_global_norm(grad, 1.0)
        if not np.isfinite(norm):
            raise FloatingPointError(f"gradient norm {norm}")
        opt.step(params, grad, 1e-4)
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    scratch = sum(a.nbytes for ws in model._scratch.values() for a in ws._arrays.values())
    return {"times": times, "losses": losses, "params": model.space.n_params,
            "state_bytes": params.nbytes + grad.nbytes + opt.m.nbytes + opt.v.nbytes,
            "scratch_bytes": scratch, "status": proc_status()}  # while the buffers live


class Timed:
    """Wraps a method of an object: counts the seconds spent in it."""

    def __init__(self, obj, name: str):
        self.seconds, self.calls = 0.0, 0
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        setattr(obj, name, timed)


def child_lora(spec: str, base_path: str, steps: int, profile: bool) -> dict:
    from p2ptrain.lora.basefile import read_base
    from p2ptrain.models.lora import LoRAConfig, LoRARWKV
    from p2ptrain.models.rwkv import RWKV

    config = shape_config(spec)
    base = read_base(base_path)
    full = RWKV(config)  # shapes only
    model = LoRARWKV(config, LoRAConfig(RANK, ALPHA), base.frozen(full), base.id)
    widening = [Timed(model.base, "block"), Timed(model.base, "rows")]  # columns, rows
    after_build = proc_status()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        got = prof.runcall(train_loop, model, steps)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(14)
    else:
        got = train_loop(model, steps)
    got["widen_seconds_per_step"] = sum(w.seconds for w in widening) / steps
    got["widen_calls_per_step"] = sum(w.calls for w in widening) / steps
    got["base_bytes"] = model.base.nbytes
    extra = sum(a.nbytes for a in model._wide.values())
    extra += sum(v.nbytes for d in (model._vectors, model._sinks) for m in d.values()
                 for v in m.values())
    got["lora_scratch_bytes"] = extra  # widened-block scratch, frozen vectors, their sinks
    got["after_build"] = after_build
    return got


def child_full(spec: str, steps: int) -> dict:
    from p2ptrain.models.rwkv import RWKV

    return train_loop(RWKV(shape_config(spec)), steps)


# ---------------------------------------------------------------- the parent


def run_timed(args: list[str]) -> tuple[dict, int]:
    """Run this module as a child under /usr/bin/time -v: (its JSON answer, peak RSS bytes).
    /usr/bin/time is a small process, so the child's high-water mark starts small."""
    with tempfile.NamedTemporaryFile(prefix="lorabench-time-", suffix=".txt") as tf:
        cmd = ["/usr/bin/time", "-v", "-o", tf.name, sys.executable, "-m",
               "tests.bench.lorabench", *args]
        proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
        report = Path(tf.name).read_text()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{report[-2000:]}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", report)[1]) * 1024
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    return answer, peak


def exchange_bytes(n: int) -> dict[str, int]:
    """Wire bytes of one side's averaging snapshot of an n-vector: dense fp32 and the subset
    plan (all its parts; the subset for seed 0)."""
    from p2ptrain.codecs import make_codec
    from p2ptrain.codecs.wire import total_encoded_size
    from p2ptrain.proto.gossip.config import GossipConfig

    plan = GossipConfig(averaging="subset_fp16").averaging_plan(n, 0.0)
    codec, seed = plan.codec(), 0
    default = sum(total_encoded_size(codec, hi - lo)
                  for lo, hi in (plan.part_range(seed, p) for p in range(plan.parts(seed))))
    return {"dense_fp32": total_encoded_size(make_codec("none"), n), "subset_fp16": default,
            "covered": plan.covered(seed)}


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def bench_shape(spec: str, base_root: Path, steps: int, full_mode: str, profile: bool) -> dict:
    from p2ptrain import memplan
    from p2ptrain.models.lora import LoRAConfig, lora_sizes
    from p2ptrain.models.rwkv import RWKV

    config = shape_config(spec)
    full_model = RWKV(config)
    n_full = full_model.space.n_params
    n_lora, lora_flops = lora_sizes(config, LoRAConfig(RANK, ALPHA))
    t0 = time.monotonic()
    base, base_peak = run_timed(["--child", "base", "--shape", spec, "--out", str(base_root)])
    print(f"[{spec}] base {base['id']} written in {time.monotonic() - t0:.0f} s "
          f"({base['size'] / GB:.3f} GB; writer peak {base_peak / GB:.2f} GB)",
          file=sys.stderr, flush=True)
    lora_args = ["--child", "lora", "--shape", spec, "--base-path", base["path"],
                 "--steps", str(steps)] + (["--profile"] if profile else [])
    lora, lora_peak = run_timed(lora_args)
    print(f"[{spec}] lora: peak {lora_peak / GB:.3f} GB, steps {lora['times']}",
          file=sys.stderr, flush=True)
    predicted = memplan.rwkv_footprint(config).total
    room = mem_available() - FULL_MARGIN
    measure = full_mode == "measure" or (full_mode == "auto" and predicted <= room)
    full = None
    if measure:
        full, full_peak = run_timed(["--child", "full", "--shape", spec, "--steps", str(steps)])
        full["peak"] = full_peak
        print(f"[{spec}] full: peak {full_peak / GB:.3f} GB, steps {full['times']}",
              file=sys.stderr, flush=True)
    C = config.n_embd
    block_matrices = sum(full_model.space.slot(f"blocks.{i}.{m}").size
                         for i in range(config.n_layer)
                         for m in ("att.key", "att.value", "att.receptance", "att.output",
                                   "ffn.key", "ffn.receptance", "ffn.value"))
    return {
        "shape": spec, "n_layer": config.n_layer, "n_embd": C, "vocab": config.vocab_size,
        "n_full": n_full, "n_lora": n_lora, "lora_flops": lora_flops,
        "full_flops": full_model.flops_per_token(), "base": base,
        "lora": lora, "lora_peak": lora_peak, "lora_step": median(lora["times"][1:]),
        "full": full, "full_step": median(full["times"][1:]) if full else None,
        "full_predicted": predicted,
        "block_ratio": n_lora / block_matrices, "block_ratio_formula": 20 * RANK / (13 * C),
        "exchange_lora": exchange_bytes(n_lora), "exchange_full": exchange_bytes(n_full),
    }


def report(r: dict) -> list[str]:
    """Human-readable lines for one shape."""
    lo, st = r["lora"], r["lora"]["status"]
    mb = 1e6
    lines = [
        f"## {r['shape']}: {r['n_layer']} x {r['n_embd']}, vocabulary {r['vocab']}, "
        f"{r['n_full'] / 1e6:,.1f}M parameters; LoRA r={RANK}: {r['n_lora'] / 1e6:.2f}M "
        f"adapter parameters",
        f"LoRA   peak RSS {r['lora_peak'] / GB:.3f} GB; step {r['lora_step']:.3f} s "
        f"(median of {len(lo['times']) - 1} after the first, fastest "
        f"{min(lo['times'][1:]):.3f} s; first {lo['times'][0]:.2f} s); "
        f"widening {lo['widen_seconds_per_step']:.2f} s/step "
        f"({lo['widen_calls_per_step']:.0f} blocks); loss {lo['losses'][0]:.3f} -> "
        f"{lo['losses'][-1]:.3f}",
        f"       after the steps: RssFile {st['RssFile'] / mb:,.0f} MB (base "
        f"{lo['base_bytes'] / mb:,.0f} MB mapped, and libraries), RssAnon "
        f"{st['RssAnon'] / mb:,.0f} MB: adapters, gradient, AdamW {lo['state_bytes'] / mb:,.0f}"
        f" MB, activations {lo['scratch_bytes'] / mb:,.0f} MB, widening scratch and frozen "
        f"vectors {lo['lora_scratch_bytes'] / mb:,.0f} MB, the rest interpreter and libraries "
        f"(RSS {lo['after_build']['VmRSS'] / mb:,.0f} MB once the model is built)",
    ]
    if r["full"]:
        f = r["full"]
        lines.append(f"full   peak RSS {r['full']['peak'] / GB:.3f} GB (memplan "
                     f"{r['full_predicted'] / GB:.3f}); step {r['full_step']:.3f} s "
                     f"(fastest {min(f['times'][1:]):.3f} s; first {f['times'][0]:.2f} s)")
    else:
        lines.append(f"full   memplan {r['full_predicted'] / GB:.3f} GB (not run: above the "
                     f"available memory less {FULL_MARGIN / GIB:.0f} GiB)")
    el, ef = r["exchange_lora"], r["exchange_full"]
    lines += [
        f"averaging exchange, one side: adapters dense fp32 {el['dense_fp32'] / mb:,.1f} MB, "
        f"10% subset fp16 {el['subset_fp16'] / mb:,.2f} MB; full dense fp32 "
        f"{ef['dense_fp32'] / mb:,.1f} MB, subset {ef['subset_fp16'] / mb:,.1f} MB; "
        f"adapters/full {el['subset_fp16'] / ef['subset_fp16']:.4f} (block matrices "
        f"{r['block_ratio']:.4f}, 20r/13C = {r['block_ratio_formula']:.4f})",
        f"FLOPs/token: LoRA {r['lora_flops'] / 1e9:.2f} G, full {r['full_flops'] / 1e9:.2f} G",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", default=[],
                    help=f"{', '.join(SHAPES)} or LxC[:V]; repeat for several")
    ap.add_argument("--base-dir", type=Path, help="where bases go (default: a temporary "
                    "directory, removed at the end)")
    ap.add_argument("--steps", type=int, default=4, help="training steps per run (>= 2)")
    ap.add_argument("--full", choices=("auto", "measure", "model"), default="auto",
                    help="full training: measured if it fits (auto), always, or memplan only")
    ap.add_argument("--profile", action="store_true", help="cProfile the LoRA child")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--child", choices=("base", "lora", "full"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--base-path", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = args.shape[0]
        got = (child_base(spec, args.out) if args.child == "base"
               else child_lora(spec, args.base_path, args.steps, args.profile)
               if args.child == "lora" else child_full(spec, args.steps))
        print(json.dumps(got), flush=True)
        return 0
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step is not timed)")
    root = args.base_dir or Path(tempfile.mkdtemp(prefix="lorabench-"))
    results = []
    try:
        for spec in args.shape or ["1b3"]:
            results.append(bench_shape(spec, root, args.steps, args.full, args.profile))
            print("\n".join(report(results[-1])) + "\n", flush=True)
    finally:
        if args.base_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
