"""The driver side of the dashboard's history (history.py): a logging handler on the node's
reporter that notes every event as it is logged, and a loop that samples the status document
once a second. It owns no state of its own beyond the History it fills.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from p2ptrain.net.history import History
from p2ptrain.net.progress import every_second
from p2ptrain.report import Reporter


class _Tap(logging.Handler):
    """Notes each record of the reporter in the history, with the node's clock."""

    def __init__(self, history: History, now: Callable[[], float]):
        super().__init__()
        self.history, self.now = history, now

    def emit(self, record: logging.LogRecord) -> None:
        self.history.note(self.now(), record.levelname.lower(),
                          getattr(record, "event", "info"),
                          getattr(record, "plain", None) or record.getMessage())


class Watch:
    """A node's History, fed from its reporter from now on and from `sample_loop` once it
    runs; `close()` detaches it from the reporter."""

    def __init__(self, reporter: Reporter, now: Callable[[], float],
                 history: History | None = None):
        self.reporter, self.now = reporter, now
        self.history = history or History()
        self.tap = _Tap(self.history, now)
        reporter.log.addHandler(self.tap)

    def document(self) -> dict[str, Any]:
        """The GET /v1/history document, as of now."""
        return self.history.document(self.now())

    async def sample_loop(self, status: Callable[[], dict[str, Any]]) -> None:
        """Sample `status()` into the history once a second until cancelled."""
        await every_second(lambda: self.history.sample(self.now(), status()))

    def close(self) -> None:
        self.reporter.log.removeHandler(self.tap)
