"""Real processes: a partner killed mid-run does not hold a node's averaging slot. Its requests
to the dead partner are refused at connect (nothing listens on the port): the runtime reports
each as `Unanswered` and the exchange ends at once, where it used to wait for the membership
to find the partner dead or for its give-up (90 s). And the partner restarted on the same port
and state is averaged with again."""

from __future__ import annotations

import pytest

from tests.swarmlab import SMALL_SWARM_TOML, SwarmLab, free_ports, wait_for

pytestmark = [pytest.mark.processes, pytest.mark.slow]

EVERY_STEP = SMALL_SWARM_TOML.replace("fanout = 2  #", "average_every = 1\nfanout = 0  #")


def _gossip(proc) -> dict:
    return proc.status()["gossip"]


def test_a_killed_partner_ends_the_exchange_at_once_and_a_restarted_one_averages(tmp_path):
    with SwarmLab(tmp_path, config_text=EVERY_STEP) as lab:
        ports = free_ports(2)
        a = lab.start("a", ports[0], [f"127.0.0.1:{ports[1]}"])
        b = lab.start("b", ports[1], [a.addr])
        wait_for("both to average", lambda: all(
            _gossip(p).get("average_applied", 0) >= 20 for p in (a, b)), 90)
        lab.kill(b)
        b.popen.wait(30)
        # a's next requests find no listener: each ends its exchange when refused, long
        # before the membership calls b dead (seconds) or a give-up (90 s)
        wait_for("a's exchange with the dead partner to end unanswered",
                 lambda: _gossip(a).get("average_unanswered", 0) >= 1, 30)
        assert _gossip(a).get("average_timeout", 0) == 0
        b2 = lab.start("b", ports[1], [a.addr], state=b.state_dir)
        applied = _gossip(a).get("average_applied", 0)
        wait_for("a to average with the restarted partner",
                 lambda: b2.status()["phase"] == "training"
                 and _gossip(a).get("average_applied", 0) >= applied + 10, 90)
        assert _gossip(a).get("average_timeout", 0) == 0
