"""Prefix affinity's bookkeeping (`serving.ray_router.PrefixAffinity`): which replica served which prefix, by
whole blocks, least recently used out; the router around it is exercised on a live Ray cluster in
test_ray_replicas.py."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from specrl.serving.ray_router import PrefixAffinity  # noqa: E402


def test_the_replica_that_served_the_longest_prefix_owns_a_new_context():
    affinity = PrefixAffinity(block_chars=4)
    affinity.record("system A|question 1", "r1")
    affinity.record("system A|other", "r2")  # the 2 blocks "syst", "em A" now belong to r2, "|que.." stays r1
    assert affinity.owner("system A|question 2", {"r1", "r2"}) == ("r1", 4)  # "syst" "em A" "|que" "stio" known
    assert affinity.owner("system A|zzz", {"r1", "r2"}) == ("r2", 2)
    assert affinity.owner("system A|question 2", {"r2"}) == ("r2", 2)  # r1 is not a candidate (dead, full)
    assert affinity.owner("other system", {"r1", "r2"}) == (None, 0)
    assert affinity.owner("sys", {"r1", "r2"}) == (None, 0)  # no whole block


def test_a_block_is_keyed_by_everything_before_it():
    affinity = PrefixAffinity(block_chars=4)
    affinity.record("aaaabbbb", "r1")
    assert affinity.owner("ccccbbbb", {"r1"}) == (None, 0)  # the same second block after another first one
    assert affinity.keys("aaaabbbbcc") == affinity.keys("aaaabbbb")  # a partial block has no key


def test_owned_counts_follow_records_evictions_and_forgetting():
    affinity = PrefixAffinity(block_chars=2, capacity=4)
    affinity.record("aabb", "r1")  # 2 keys
    affinity.record("ccdd", "r2")  # 2 keys
    assert (affinity.owned("r1"), affinity.owned("r2")) == (2, 2)
    affinity.record("aabb", "r2")  # r1's keys move to r2
    assert (affinity.owned("r1"), affinity.owned("r2")) == (0, 4)
    affinity.record("eeff", "r1")  # over capacity: the least recently used keys (ccdd's) go
    assert (affinity.owned("r1"), affinity.owned("r2")) == (2, 2)
    assert affinity.owner("ccdd", {"r1", "r2"}) == (None, 0)
    assert affinity.owner("aabb", {"r1", "r2"}) == ("r2", 2)
    affinity.forget("r2")
    assert affinity.owned("r2") == 0 and affinity.owner("aabb", {"r1", "r2"}) == (None, 0)
    assert affinity.owner("eeff", {"r1"}) == ("r1", 2)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_chars"):
        PrefixAffinity(block_chars=0)
