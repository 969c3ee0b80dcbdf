"""p2ptrain/net/stopsignals.py: a runtime in the process gives SIGINT and SIGTERM back as it
found them (a test run's SIGTERM handler, which removes its namespaces, was lost)."""

from __future__ import annotations

import asyncio
import os
import signal

from p2ptrain.net import stopsignals


def test_the_handlers_are_routed_while_caught_and_given_back_after():
    def mine(signum, frame):
        raise AssertionError("not while the runtime holds the signal")

    before = {s: signal.getsignal(s) for s in stopsignals.STOP_SIGNALS}
    signal.signal(signal.SIGTERM, mine)
    try:
        async def run() -> list[int]:
            loop, got = asyncio.get_running_loop(), []
            held = stopsignals.catch(loop, got.append)
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # (10 s at most)
                if got:
                    break
                await asyncio.sleep(0.01)
            stopsignals.release(loop, held)
            return got

        assert asyncio.run(run()) == [signal.SIGTERM]
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
