"""p2ptrain/net/reachability.py: when a node decides that no peer can reach it."""

from __future__ import annotations

from p2ptrain.net.reachability import Reachability


def run(reach: Reachability, successes: dict[float, int], inbound: int = 0,
        until: float = 60.0) -> float | None:
    """Look once a second, as the runtime does; `successes[t]` is the running count at t
    (held until the next entry). The time it decided, or None."""
    count, t = 0, 1.0
    while t <= until:
        count = successes.get(t, count)
        if reach.unreachable(t, inbound, count):
            return t
        t += 1.0
    return None


def test_requests_that_keep_succeeding_unanswered_by_any_inbound_decide_after_the_window():
    reach = Reachability(15.0)
    assert run(reach, {float(t): t for t in range(3, 60)}) == 18.0  # first success at 3 s
    assert not reach.unreachable(61.0, 0, 100)  # once only


def test_an_inbound_message_means_reachable():
    reach = Reachability(15.0)
    assert run(reach, {float(t): t for t in range(1, 60)}, inbound=1) is None


def test_one_success_then_peers_that_answer_nothing_is_not_unreachable():
    """A review's run: the peers were paused right after the joiner's first request
    succeeded; every later one timed out, and 15 s on it switched to outbound-only."""
    reach = Reachability(15.0)
    assert run(reach, {2.0: 1}, until=40.0) is None


def test_a_long_silence_starts_the_window_again():
    reach = Reachability(15.0)
    successes = {float(t): t for t in range(1, 11)}  # 10 s of successes
    successes |= {float(t): 10 + t for t in range(30, 60)}  # 20 s of none, then again
    assert run(reach, successes) == 45.0  # a full window from 30 s, not from 1 s


def test_successes_a_few_seconds_apart_still_count_as_reaching():
    reach = Reachability(15.0)  # gap 5 s
    assert run(reach, {float(t): t // 4 for t in range(4, 60, 4)}) == 19.0
