"""The wrong-key verdict (net/refusals.py) on a fake clock: every address asked refused us
for the window and at least MIN_REFUSALS requests -> one verdict; an accepted request clears
it; an address that only fails otherwise (still starting) holds it back."""

from __future__ import annotations

from p2ptrain.net.refusals import MIN_REFUSALS, RefusalWatch


class Watch:
    def __init__(self, window: float = 10.0):
        self.t = 0.0
        self.verdicts: list[str] = []
        self.warnings: list[str] = []
        self.w = RefusalWatch(window, lambda: self.t, self.verdicts.append,
                              self.warnings.append)

    def refuse(self, addr: str, until: float, every: float = 1.0) -> None:
        while self.t < until:
            self.w.refused(addr, "request MAC does not verify")
            self.t += every


def test_refusals_for_the_whole_window_give_one_verdict_naming_the_peers():
    w = Watch()
    w.refuse("a:1", until=9.5)
    assert w.verdicts == [] and len(w.warnings) == 1 and "a:1" in w.warnings[0]
    w.refuse("a:1", until=20)
    assert len(w.verdicts) == 1
    assert "swarm key is wrong" in w.verdicts[0] and "a:1" in w.verdicts[0]


def test_an_accepted_request_starts_the_count_again():
    w = Watch()
    w.refuse("a:1", until=8)
    w.w.accepted("b:2")
    w.refuse("a:1", until=17)
    assert w.verdicts == []
    w.refuse("a:1", until=19)
    assert len(w.verdicts) == 1


def test_a_peer_that_only_fails_otherwise_holds_the_verdict_back():
    w = Watch()
    w.w.refused("a:1", "no")
    w.w.failed("b:2")  # not up yet: it may be a member with the right key
    w.refuse("a:1", until=30)
    assert w.verdicts == []
    w.w.refused("b:2", "no")  # now it answers, and refuses too
    assert len(w.verdicts) == 1 and "a:1, b:2" in w.verdicts[0]


def test_a_short_window_still_needs_several_refusals_and_zero_means_never():
    w = Watch(window=0.001)
    for _ in range(MIN_REFUSALS - 1):
        w.refuse("a:1", until=w.t + 1)
    assert w.verdicts == []
    w.refuse("a:1", until=w.t + 1)
    assert len(w.verdicts) == 1
    never = Watch(window=0)
    never.refuse("a:1", until=1000)
    assert never.verdicts == []


def test_only_seeds_and_addresses_that_once_answered_us_count():
    t = [0.0]
    verdicts, warnings = [], []
    w = RefusalWatch(10.0, lambda: t[0], verdicts.append, warnings.append,
                     {"seed:1"}.__contains__)
    for _ in range(30):  # a stranger (found by mDNS, never answered with a MAC) refuses
        w.refused("stranger:2", "no")
        t[0] += 1
    assert verdicts == [] and len(warnings) == 1 and "proves nothing" in warnings[0]
    w.accepted("member:3")  # it held the key once...
    for _ in range(30):  # ...and refuses us now (the key was rotated): that counts
        w.refused("member:3", "rotated")
        w.refused("stranger:2", "no")  # and a stranger's refusals hold nothing back either
        t[0] += 1
    assert len(verdicts) == 1 and "member:3" in verdicts[0] and "stranger" not in verdicts[0]
    seeds_only = RefusalWatch(10.0, lambda: t[0], verdicts.append, warnings.append,
                              {"seed:1"}.__contains__)
    for _ in range(12):
        seeds_only.refused("seed:1", "no")
        t[0] += 1
    assert len(verdicts) == 2 and "seed:1" in verdicts[1]


def test_refusals_of_an_older_incarnation_say_what_happened_and_what_to_do():
    """A state directory restored from a backup starts an incarnation its peers saw before:
    they refuse it as a replay, and the node said its swarm key was wrong."""
    w = Watch()
    w.w.refused("a:1", "replay: incarnation 1 is older than 41")
    assert "restored from a backup" in w.warnings[0] and "write 42" in w.warnings[0]
    while w.t < 20:
        w.w.refused("a:1", "replay: incarnation 1 is older than 41")
        w.t += 1
    assert len(w.verdicts) == 1 and "write 42" in w.verdicts[0]
    assert "swarm key is wrong" not in w.verdicts[0]
