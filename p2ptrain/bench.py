"""`p2ptrain bench`: how fast the model trains here, against what BLAS can do here.

Training tokens/s is measured on real training steps (forward, backward, AdamW) on the
built-in corpus; the model's FLOP/s follow from its `flops_per_token()` formula; the
reference is float32 1024x1024 matmul at the same (default) thread count, in the same run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from p2ptrain.config import Config, settings_of
from p2ptrain.data import load_corpus
from p2ptrain.hw import matmul_gflops
from p2ptrain.learner import Learner
from p2ptrain.startup import model_for


def run_model_bench(cfg: Config, batch: int, seconds: float,
                    progress: Callable[[str], None] | None = None) -> dict:
    settings = settings_of(cfg)
    corpus = load_corpus(settings.data.path, settings.data.holdout_fraction,
                         settings.model.ctx_len + 2)
    model, _ = model_for(settings, corpus)  # the data's vocabulary, a preset, --init-from
    learner = Learner(model, "bench", settings.train, corpus, batch, 1, 1)
    if progress:
        progress(f"measuring {model.name} training for {seconds:g}s ...")
    for _ in range(2):  # warm-up: first-touch allocations, BLAS thread start
        learner.train_step()
    steps, t0 = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - t0 < seconds:
        learner.train_step()
        steps += 1
    elapsed = time.perf_counter() - t0
    tokens_per_s = steps * batch * model.ctx_len / elapsed
    model_gflops = tokens_per_s * model.flops_per_token() / 1e9
    if progress:
        progress("measuring float32 1024x1024 matmul ...")
    mm = matmul_gflops(size=1024, seconds=min(3.0, max(seconds / 3, 0.5)))
    return {
        "model": model.name, "arch": model.arch(), "params": model.space.n_params,
        "batch": batch, "ctx_len": model.ctx_len, "steps": steps, "step_s": elapsed / steps,
        "tokens_per_s": tokens_per_s, "flops_per_token": model.flops_per_token(),
        "model_gflops": model_gflops, "matmul_gflops": mm, "ratio": model_gflops / mm,
    }
