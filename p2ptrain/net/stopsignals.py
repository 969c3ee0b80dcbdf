"""The signals that stop a networked node (SIGINT, SIGTERM): routed to the runtime's handler
while it runs, and given back as they were when it ends -- a program (or a test run) that
runs the runtime in its own process keeps its own handlers. (asyncio's
`remove_signal_handler` alone leaves the default: a test run's SIGTERM handler, which removes
its network namespaces, was lost after the first in-process node.) A driver: it changes the
process's signal handlers."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def catch(loop: asyncio.AbstractEventLoop, handler: Callable[[int], None]) -> dict[int, Any]:
    """Route STOP_SIGNALS to handler(signum) on `loop`; returns what each had before."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s in STOP_SIGNALS:
        loop.add_signal_handler(s, handler, s)
    return previous


def release(loop: asyncio.AbstractEventLoop, previous: dict[int, Any]) -> None:
    """Undo `catch`: each signal gets back the handler it had (asyncio's default if that was
    not set from Python)."""
    for s, before in previous.items():
        loop.remove_signal_handler(s)
        if before is not None:
            signal.signal(s, before)
