"""Progress output for people (one line per event) or for programs (one JSON object per line:
time, level, node id, event, message and the event's fields), through the standard `logging`
module.

Messages go to stdout, warnings and errors to stderr; every line is flushed at once so that a
container log or a pipe shows progress live.
"""

from __future__ import annotations

import datetime
import json
import logging
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


class _Lines(logging.Formatter):
    """One record as a line: the text for people, or one JSON object for programs with the
    time (RFC 3339, UTC), level, node id, event and the event's fields."""

    def __init__(self, fmt: str, reporter: Reporter):
        super().__init__()
        self.fmt, self.reporter = fmt, reporter

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if self.fmt != "json":
            return text
        when = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        doc = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
               "level": record.levelname.lower(), "node_id": self.reporter.node_id,
               "event": getattr(record, "event", "info"), "message": text,
               **getattr(record, "fields", {})}
        return json.dumps(doc, default=str)


class _Flushing(logging.StreamHandler):
    """A stream handler that looks up its stream at every record (tests swap sys.stdout)."""

    def __init__(self, stream_of, fmt: logging.Formatter, keep):
        super().__init__()
        self.stream_of = stream_of
        self.setFormatter(fmt)
        self.addFilter(keep)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = self.stream_of()
        super().emit(record)


class Reporter:
    """A node's output through the standard `logging` module: info to stdout, warnings and
    errors to stderr, every line flushed at once; `--log-format json` makes each line a JSON
    object with time, level, node id and event. `node_id` is set once the node knows it."""

    def __init__(self, fmt: str = "text", out: TextIO | None = None, err: TextIO | None = None):
        self.fmt = fmt
        self.out, self.err = out, err
        self.node_id: str | None = None
        # a logger of its own, not registered with logging's manager (which never frees one):
        # no parent, so nothing propagates to the root logger
        self.log = logging.Logger("p2ptrain.report", logging.INFO)
        lines = _Lines(fmt, self)
        self.log.addHandler(_Flushing(lambda: self.out or sys.stdout, lines,
                                      lambda r: r.levelno < logging.WARNING))
        self.log.addHandler(_Flushing(lambda: self.err or sys.stderr, lines,
                                      lambda r: r.levelno >= logging.WARNING))

    def _emit(self, level: int, event: str, text: str, fields: dict, prefix: str = "") -> None:
        """A record whose `plain` attribute is the text without the text-mode `prefix` (for
        handlers other than the output's, like the dashboard's event list)."""
        self.log.log(level, "%s", (prefix if self.fmt == "text" else "") + text,
                     extra={"event": event, "fields": fields, "plain": text})

    def info(self, text: str, event: str = "info", **fields) -> None:
        self._emit(logging.INFO, event, text, fields)

    def warn(self, text: str, event: str = "warning", **fields) -> None:
        self._emit(logging.WARNING, event, text, fields, prefix="warning: ")

    def error(self, text: str, event: str = "error", **fields) -> None:
        """A problem that ends the run (the CLI's own errors print the same way)."""
        self._emit(logging.ERROR, event, text, fields, prefix="p2ptrain: error: ")

    def evaluated(self, step: int, eval_loss: float, average: float | None,
                  elapsed: float) -> None:
        """A held-out evaluation: the weights' loss, and with `train.ema` the average's (what
        checkpoints carry)."""
        also = "" if average is None else f"; the average in checkpoints {average:.3f}"
        self._emit(logging.INFO, "eval", f"held-out loss {eval_loss:.3f}{also} at step {step} "
                   f"({elapsed:.0f}s)", {"step": step, "eval_loss": eval_loss,
                                         "average_eval_loss": average, "elapsed_s": elapsed})

    def stopped(self, reason: str | None, step: int, samples: int,
                eval_loss: float | None) -> None:
        """The run's last line: why it stopped and how far it got."""
        held = f", held-out loss {eval_loss:.3f}" if eval_loss is not None else ""
        self._emit(logging.INFO, "stopped", f"stopped: {reason}; at step {step}, "
                   f"{human_count(samples)} samples{held}",  # (the run's, not this start's)
                   {"reason": reason, "step": step, "eval_loss": eval_loss})

    def progress(self, step: int, loss: float, eval_loss: float | None, tokens_per_s: float,
                 samples: int, swarm_samples: int, total_samples: int, lr: float,
                 checkpoint_age: float | None) -> None:
        pct = 100.0 * swarm_samples / max(total_samples, 1)
        ev = f"{eval_loss:.3f}" if eval_loss is not None else "-"
        text = (f"step {step:>6} | loss {loss:.3f} | held-out {ev} | "
                f"{human_count(tokens_per_s)} tok/s | samples {human_count(samples)} "
                f"({pct:.1f}% of run) | lr {lr:.2e} | checkpoint {human_age(checkpoint_age)}")
        self._emit(logging.INFO, "progress", text, {
            "step": step, "loss": loss, "eval_loss": eval_loss, "tokens_per_s": tokens_per_s,
            "samples": samples, "swarm_samples": swarm_samples, "lr": lr,
            "checkpoint_age_s": checkpoint_age})
