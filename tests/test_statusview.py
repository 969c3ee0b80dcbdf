"""`p2ptrain status` renders any /v1/status document (an open route: anything may answer)."""

import pytest

from p2ptrain.cli.statusview import MAX_ROWS, status_lines

GOOD = {"swarm": "fleet", "node_id": "a" * 64, "phase": "training", "leader": "b" * 64,
        "term": 3, "swarm_samples": 12345, "addr": "10.0.0.1:7100", "device_class": "server",
        "step": 40, "loss": 2.5, "samples": 1500, "bytes_in": 2_500_000, "bytes_out": 900,
        "holds": {"term": 3, "step": 38, "digest": "0123456789abcdef"},
        "runtime": {"served_bytes": 4_000_000},
        "members": [{"node_id": "b" * 64, "addr": "10.0.0.2:7100", "device_class": "rpi4",
                     "state": "alive", "step": 12, "loss": 2.75, "samples": 96,
                     "bytes_in": 1_000, "bytes_out": 3_000_000, "rtt_ms": 4.25}]}


def test_a_status_document_is_a_header_a_holding_and_a_row_a_node():
    lines = status_lines(GOOD)
    assert lines[0] == ("swarm 'fleet' | node aaaaaaaaaaaa (training) | leader bbbbbbbbbbbb "
                        "(term 3) | swarm samples 12,345")
    assert lines[1] == "holds checkpoint t3-s38 (0123456789abcdef) | served 4.0MB of checkpoints"
    head, me, peer = (line.split() for line in lines[2:5])
    assert head == ["node", "address", "class", "state", "step", "loss", "samples", "in", "out",
                    "rtt"]
    assert me == ["aaaaaaaaaaaa*", "10.0.0.1:7100", "server", "training", "40", "2.500", "1.5k",
                  "2.5MB", "900B", "-"]
    assert peer == ["bbbbbbbbbbbb", "L", "10.0.0.2:7100", "rpi4", "alive", "12", "2.750", "96",
                    "1.0kB", "3.0MB", "4.2ms"]
    assert lines[-1] == "(* this node, L the leader)"


@pytest.mark.parametrize("doc", [
    {}, {"node_id": 7, "step": float("inf"), "loss": "x"}, {"node_id": "abc", "holds": 5},
    {"holds": {"term": "t", "step": [], "digest": 1}}, {"runtime": 3, "members": "many"},
    {"members": [5, None, {"node_id": None, "rtt_ms": "fast", "bytes_in": True}]},
    {"leader": ["a"], "term": float("nan"), "swarm_samples": {"n": 1}},
    {"node_id": "abc", "step": 10**300, "loss": 1e300, "bytes_in": 1e300, "samples": -10**40,
     "term": 10**300, "swarm_samples": 1e300},
])
def test_fields_of_the_wrong_type_show_as_a_dash_not_a_traceback(doc):
    lines = status_lines(doc)
    assert lines[-1] == "(* this node, L the leader)" and len(lines) >= 4
    assert max(len(line) for line in lines) < 200
    assert "None" not in "".join(lines[2:]) and "nan" not in "".join(lines)


def test_text_from_the_network_cannot_reach_the_terminal_raw_nor_flood_it():
    evil = {"node_id": "\x1b[2J\x1b[31mred" + "z" * 500, "swarm": "s\x07\rx",
            "members": [{"node_id": f"{i:064x}", "addr": "\x1b]0;title\x07"}
                        for i in range(MAX_ROWS + 5)]}
    lines = status_lines(evil)
    assert not any(c in "".join(lines) for c in "\x1b\x07\r")
    assert max(len(line) for line in lines) < 300
    assert len(lines) == 2 + MAX_ROWS + 1 + 2 and "and 5 members more" in lines[-2]
