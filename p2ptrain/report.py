"""Progress output for people (one line per event) or for programs (one JSON object per line).

Messages go to stdout, warnings and errors to stderr; every line is flushed at once so that a
container log or a pipe shows progress live.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO


def human_count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "none"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    return f"{seconds / 60:.0f}m ago"


class Reporter:
    def __init__(self, fmt: str = "text", out: TextIO | None = None, err: TextIO | None = None):
        self.fmt = fmt
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def _emit(self, stream: TextIO, event: str, text: str, fields: dict) -> None:
        if self.fmt == "json":
            stream.write(json.dumps({"event": event, "message": text, **fields}) + "\n")
        else:
            stream.write(text + "\n")
        stream.flush()

    def info(self, text: str, event: str = "info", **fields) -> None:
        self._emit(self.out, event, text, fields)

    def warn(self, text: str, event: str = "warning", **fields) -> None:
        self._emit(self.err, event, ("warning: " if self.fmt == "text" else "") + text, fields)

    def error(self, text: str, event: str = "error", **fields) -> None:
        """A problem that ends the run (the CLI's own errors print the same way)."""
        self._emit(self.err, event, ("p2ptrain: error: " if self.fmt == "text" else "") + text,
                   fields)

    def progress(self, step: int, loss: float, eval_loss: float | None, tokens_per_s: float,
                 samples: int, swarm_samples: int, total_samples: int, lr: float,
                 checkpoint_age: float | None) -> None:
        pct = 100.0 * swarm_samples / max(total_samples, 1)
        ev = f"{eval_loss:.3f}" if eval_loss is not None else "-"
        text = (f"step {step:>6} | loss {loss:.3f} | held-out {ev} | "
                f"{human_count(tokens_per_s)} tok/s | samples {human_count(samples)} "
                f"({pct:.1f}% of run) | lr {lr:.2e} | checkpoint {human_age(checkpoint_age)}")
        self._emit(self.out, "progress", text, {
            "step": step, "loss": loss, "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
            "samples": samples, "swarm_samples": swarm_samples, "lr": lr,
            "checkpoint_age_s": checkpoint_age})
