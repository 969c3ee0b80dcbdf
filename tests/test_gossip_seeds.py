"""Who chooses an averaging exchange's coordinates (seeds.py): the seed of each exchange after
a pair's first is derived from the initiator's committed nonce and the responder's grant, so
neither a member sending requests nor one answering them can steer which coordinates its
exchanges cover. Pure: the two sides' `Seeds` talk directly, times are passed in."""

from __future__ import annotations

import pytest

from p2ptrain.proto.gossip.messages import AverageReply, AverageRequest
from p2ptrain.proto.gossip.plan import FAST_PAIR
from p2ptrain.proto.gossip.seeds import (
    MAX_PAIRS,
    MAX_SEED,
    NO_NONCE,
    NONCE_BYTES,
    RESET_GAP,
    Seeds,
    commit_of,
    derive,
)

I, R = "aa" * 16, "bb" * 16


def _pair(shares: bool = False) -> tuple[Seeds, Seeds]:
    return Seeds(I, b"i" * 32, shares), Seeds(R, b"r" * 32, shares)


def _open(i: Seeds, fresh: int = 5) -> tuple[int, bytes, bytes]:
    """`opening` toward R, its hex as bytes."""
    seed, reveal, commit = i.opening(R, fresh)
    return seed, bytes.fromhex(reveal), bytes.fromhex(commit)


def _exchange(i: Seeds, r: Seeds, now: float = 0.0, fresh: int = 5) -> tuple[int, bool]:
    """One first part from i to r, answered if it follows: (its seed, whether r took it)."""
    seed, reveal, commit = _open(i, fresh)
    if r.check(I, seed, 0, reveal):
        i.answered(R, seed, r.taken(I, seed, 0, commit), False)
        return seed, True
    grant = r.refused(I, now, 0, commit)
    i.answered(R, seed, grant, not grant)
    return seed, False


def test_an_honest_pair_follows_its_chain_and_its_seeds_are_nobodys_choice():
    i, r = _pair()
    seeds = [_exchange(i, r, fresh=5) for _ in range(50)]
    assert all(taken for _, taken in seeds)
    assert seeds[0][0] == 5  # the first: the initiator's own
    later = [s for s, _ in seeds[1:]]
    assert len(set(later)) == len(later) and all(0 <= s < MAX_SEED for s in later)
    nonce, grant = i.mine[R]  # the next: from the nonce it committed to and r's grant
    assert r.theirs[I] == (commit_of(nonce), grant)
    assert i.opening(R, 5)[0] == derive(nonce, grant, I, R)


@pytest.mark.parametrize("shares", [False, True])
def test_a_seed_of_the_initiators_own_choice_is_declined_after_the_first(shares):
    i, r = _pair(shares)
    _exchange(i, r)
    seed, reveal, commit = _open(i)
    assert r.check(I, seed, 0, reveal)
    # the FAST_PAIR bit, which also changes the subset, is the initiator's only in a plan
    # with a slow share (where it says which share is covered)
    assert r.check(I, seed ^ FAST_PAIR, 0, reveal) == shares
    assert not r.check(I, seed ^ 2, 0, reveal)
    assert not r.check(I, 12345, 0, b"")
    other = b"x" * NONCE_BYTES  # another nonce than the one it committed to
    assert not r.check(I, derive(other, r.theirs[I][1], I, R), 0, other)


def test_a_grant_pairs_with_the_nonce_still_secret_when_it_was_drawn():
    """A responder sees the nonce an initiator reveals; its grant, answering that request,
    goes with the next nonce, of which it has only seen the commitment."""
    i, r = _pair()
    _exchange(i, r)
    seed, reveal, commit = _open(i)
    i.answered(R, seed, 777, False)  # any grant a responder likes
    nonce, grant = i.mine[R]
    assert grant == 777 and nonce != reveal and commit_of(nonce) == commit


def test_declines_keep_the_chain_and_a_reply_to_an_older_exchange_is_ignored():
    i, r = _pair()
    _exchange(i, r)
    before = dict(i.mine)
    seed, _, _ = _open(i)
    i.answered(R, seed, 0, False)  # declined (busy, crowded, crossing): retried alike
    assert i.mine == before and i.opening(R, 5)[0] == seed
    i.answered(R, seed ^ 4, 999, False)  # not our last exchange's
    assert i.mine == before


def test_a_lost_reply_costs_one_exchange_and_a_restart_two():
    i, r = _pair()
    _exchange(i, r)
    seed, reveal, commit = _open(i)
    assert r.check(I, seed, 0, reveal)
    r.taken(I, seed, 0, commit)  # answered, but the reply is lost
    assert _exchange(i, r, now=100.0) == (seed, False)  # declined, a new chain granted
    assert _exchange(i, r, now=101.0)[1]  # and followed
    i.mine.clear()  # the initiator restarted
    assert not _exchange(i, r, now=102.0)[1]  # too soon after the last new chain: told to
    assert R not in i.mine  # start over
    assert not _exchange(i, r, now=102.0 + RESET_GAP)[1]  # now granted
    assert _exchange(i, r, now=103.0 + RESET_GAP)[1]


def test_new_chains_come_at_most_once_every_reset_gap():
    """Each new chain is a fresh draw of the seed: a member may not redraw until it likes
    the subset faster than that."""
    i, r = _pair()
    _exchange(i, r)
    grants = 0
    for k in range(100):  # a request that does not follow, every 0.5 s for 50 s
        seed, reveal, commit = _open(i)
        grants += bool(r.refused(I, 0.5 * k, 0, commit))
    assert grants == int(50 / RESET_GAP)


def test_later_parts_carry_the_first_parts_seed_in_order_none_skipped_once_each():
    i, r = _pair()
    seed, reveal, commit = _open(i)
    assert not r.check(I, seed, 1, b"")  # no first part taken yet
    assert r.check(I, seed, 0, reveal)
    r.taken(I, seed, 0, commit)
    assert r.check(I, seed, 1, b"") and not r.check(I, seed ^ 2, 1, b"")
    assert not r.check(I, seed, 3, b"")  # no skipping to the part that holds a target
    assert r.taken(I, seed, 1, b"") == 0  # later parts move no chain
    assert not r.check(I, seed, 1, b"")  # once
    assert r.check(I, seed, 2, b"")


def test_the_tables_are_bounded():
    r = Seeds(R, b"r" * 32)
    for k in range(MAX_PAIRS + 10):
        peer = f"{k:032x}"
        r.taken(peer, 1, 0, b"c" * 16)
        r.refused(peer, 0.0, 0, b"c" * 16)
    assert len(r.theirs) == MAX_PAIRS and len(r.parts) <= MAX_PAIRS + 1
    assert len(r.resets) <= MAX_PAIRS


def test_the_wire_checks_nonce_commitment_and_grant():
    ok = AverageRequest(1, 0, {}, (b"x",), 0, 1, None, "ab" * NONCE_BYTES, "0c" * 16)
    ok.check()
    assert ok.nonce == b"\xab" * NONCE_BYTES and ok.commitment == b"\x0c" * 16
    for reveal, commit in (("ab", ""), ("", "0c" * 17), ("zz" * NONCE_BYTES, ""),
                           ("AB" * NONCE_BYTES, "")):
        with pytest.raises(ValueError, match="nonce or commitment"):
            AverageRequest(1, 0, {}, (b"x",), 0, 1, None, reveal, commit).check()
    with pytest.raises(ValueError, match="grant"):
        AverageReply(1, 0, {}, (), 0, 1, None, -1).check()


def test_a_requests_size_does_not_depend_on_its_chain():
    """The simulator charges each message its exact frame: a first exchange's request (no
    nonce to reveal) is as long as a later one's."""
    from p2ptrain.proto.schema import compile_class

    i, r = _pair()
    sizes = set()
    for _ in range(3):
        seed, reveal, commit = i.opening(R, 5)
        body = AverageRequest(1, 0, {}, (b"x",), 0, 1, None, reveal, commit)  # (seed aside)
        body.check()
        enc, _ = compile_class(AverageRequest)
        sizes.add(len(str(enc(body, []))))
        i.answered(R, seed, r.taken(I, seed, 0, bytes.fromhex(commit)), False)
    assert len(sizes) == 1 and NO_NONCE == "0" * 2 * NONCE_BYTES


def test_honest_nodes_follow_their_chains():
    """Four real protocol nodes, virtual time: every exchange after a pair's first follows
    its chain; none is declined for its seed."""
    from tests.test_gossip_guard import _cluster

    c = _cluster(4)
    c.run_until(30.0)
    trainers = [c.training_node(k).trainer for k in range(4)]
    assert sum(t.stats["average_applied"] for t in trainers) > 100
    assert sum(t.stats["average_declined_seed"] for t in trainers) == 0
    assert all(len(t.seeds.theirs) == 3 for t in trainers)  # a chain with each peer
