"""Prefix affinity for the fleet's replicas on Ray Serve: a request goes where its context's start was computed last.

Each replica keeps the KV of recent requests in its prefix cache (`engine/prefix_cache.py`: one entry per KV slot,
least recently used out), so a prompt that starts like a recent one skips most of its prefill, but only on the
replica that computed that start. Serve's default router (power of two choices on queue lengths) spreads a
prompt's repeats over every replica, so each replica must hold every hot prefix; routed by prefix, each holds
its share, and N replicas' caches hold N times as many prefixes.

`PrefixAffinity` is the bookkeeping: a context's text cut into BLOCK_CHARS-character blocks, each keyed by a hash
of everything up to its end (a chain, as vLLM keys KV blocks), so a key names one whole prefix; each key maps to
the replica that served it last, least recently used keys out past `capacity`. `PrefixAffinityRouter` is the
Serve `RequestRouter` around it, ranking for each request:
1. the replica that served its longest known prefix, unless that replica's queue is longer than the shortest by
   more than `imbalance` (a hot prefix must not pile onto one replica while others idle);
2. for a prefix no replica has served, the replicas owning the fewest keys (new prefixes spread evenly);
3. two replicas at random (Serve's power of two choices), for requests with no prompt (/metrics, admin calls)
   or one shorter than a block, and when the replicas above are full.
Serve picks the shortest queue within the first rank that has a replica accepting the request. Characters stand
in for tokens (the front has no tokenizer): a chat template adds the same text before the same messages, so
equal text prefixes are equal token prefixes up to the block cut at the end.

The router runs in the process that holds the handle (the front); the request's first argument names its text
(`prefix_text`, `serving.forwarding.ForwardedRequest`). Needs the `[ray]` extra.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable

from ray.serve.request_router import RequestRouter

BLOCK_CHARS = 256  # ~60 tokens of English: a shared system prompt of 1,000 tokens is ~16 blocks


class PrefixAffinity:
    def __init__(self, block_chars: int = BLOCK_CHARS, capacity: int = 100_000):
        if block_chars < 1 or capacity < 1:
            raise ValueError(f"block_chars and capacity must be >= 1 (got {block_chars}, {capacity})")
        self.block_chars, self.capacity = block_chars, capacity
        self._owner: OrderedDict[int, Hashable] = OrderedDict()  # prefix key -> replica, least recently used first
        self._owned: dict[Hashable, int] = {}  # replica -> keys it owns

    def keys(self, text: str) -> list[int]:
        """One key per whole block of `text`: key i names text[:(i + 1) * block_chars]."""
        keys, key = [], 0
        for end in range(self.block_chars, len(text) + 1, self.block_chars):
            key = hash((key, text[end - self.block_chars:end]))
            keys.append(key)
        return keys

    def owner(self, text: str, replicas) -> tuple[Hashable | None, int]:
        """-> (the replica among `replicas` that served the longest prefix of `text`, that prefix's blocks), or
        (None, 0) when none of them served a whole block of it."""
        best, matched = None, 0
        for i, key in enumerate(self.keys(text)):
            replica = self._owner.get(key)
            if replica is None:
                break  # a chain key: no longer prefix can be known either
            if replica in replicas:
                best, matched = replica, i + 1
        return best, matched

    def record(self, text: str, replica: Hashable) -> None:
        """`replica` now holds `text`'s KV: each of its prefixes is owned by it and most recently used."""
        for key in self.keys(text):
            previous = self._owner.pop(key, None)
            if previous is not None:
                self._disown(previous)
            self._owner[key] = replica
            self._owned[replica] = self._owned.get(replica, 0) + 1
        while len(self._owner) > self.capacity:
            _, evicted = self._owner.popitem(last=False)
            self._disown(evicted)

    def owned(self, replica: Hashable) -> int:
        return self._owned.get(replica, 0)

    def forget(self, replica: Hashable) -> None:
        """A replica that died took its cache with it."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]
        self._owned.pop(replica, None)

    def _disown(self, replica: Hashable) -> None:
        self._owned[replica] -= 1
        if not self._owned[replica]:
            del self._owned[replica]


class PrefixAffinityRouter(RequestRouter):
    """Serve's `RequestRouter` ranking replicas by prefix affinity (the module docstring); configured per
    deployment through `RequestRouterConfig(request_router_class=PrefixAffinityRouter,
    request_router_kwargs={"imbalance": ..., "block_chars": ..., "capacity": ...})`."""

    def initialize_state(self, imbalance: int = 4, block_chars: int = BLOCK_CHARS, capacity: int = 100_000):
        self.affinity = PrefixAffinity(block_chars, capacity)
        self.imbalance = imbalance

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        ranks = []
        text = _prefix_text(pending_request)
        if len(text) >= self.affinity.block_chars:
            owner, _ = self.affinity.owner(text, by_id)
            if owner is None:
                fewest = min(self.affinity.owned(r) for r in by_id)
                tied = [by_id[r] for r in by_id if self.affinity.owned(r) == fewest]
                random.shuffle(tied)  # Serve takes the first of equal queues
                ranks.append(tied)
            elif not self._overloaded(owner, by_id):
                ranks.append([by_id[owner]])
        ranks.append(random.sample(candidate_replicas, min(2, len(candidate_replicas))))
        return ranks

    def on_request_routed(self, pending_request, replica_id, result):
        text = _prefix_text(pending_request)
        if text:
            self.affinity.record(text, replica_id)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id)

    def _overloaded(self, replica_id, replica_ids) -> bool:
        """Its queue (as last probed) is longer than the shortest by more than `imbalance`; unknown is not."""
        lengths = {r: self.replica_queue_len_cache.get(r) for r in replica_ids}
        own = lengths[replica_id]
        known = [n for n in lengths.values() if n is not None]
        return own is not None and own - min(known) > self.imbalance


def _prefix_text(pending_request) -> str:
    if pending_request is None or not pending_request.args:
        return ""
    return getattr(pending_request.args[0], "prefix_text", "") or ""
