"""Tables a hostile peer could grow, and counters it could push to their limit, stay bounded."""

from __future__ import annotations

import pytest

from p2ptrain.proto.records import MAX_EPOCH, check_epoch
from p2ptrain.swarmcount import MAX_ENTRIES, SwarmCount


def test_the_sample_counter_stops_taking_new_ids_at_its_bound_but_keeps_growing_known_ones():
    count = SwarmCount({f"{i:032x}": 1 for i in range(MAX_ENTRIES)})
    count.merge({"f" * 32: 5})  # one id too many: ignored
    assert count.get("f" * 32) == 0 and len(count.as_dict()) == MAX_ENTRIES
    count.merge({f"{0:032x}": 7})  # a known id still grows
    assert count.get(f"{0:032x}") == 7


def test_terms_and_incarnations_leave_room_for_one_more():
    check_epoch(MAX_EPOCH, "term")
    for bad in (MAX_EPOCH + 1, -1, True, 1.0):
        with pytest.raises(ValueError):
            check_epoch(bad, "term")


def test_discovered_addresses_are_bounded_most_recent_kept():
    from p2ptrain.proto.config import LOCAL
    from p2ptrain.proto.membership.swim import MAX_SEEDS
    from tests.cluster.harness import Cluster

    cluster = Cluster(1, 0, LOCAL)
    membership = cluster.nodes[0].machine.membership
    for i in range(MAX_SEEDS * 3):
        membership.discovered(0.0, f"10.0.{i // 250}.{i % 250}:7100", [])
    assert len(membership.seeds) == MAX_SEEDS
    assert list(membership.seeds)[-1] == f"10.0.{(MAX_SEEDS * 3 - 1) // 250}." \
        f"{(MAX_SEEDS * 3 - 1) % 250}:7100"
