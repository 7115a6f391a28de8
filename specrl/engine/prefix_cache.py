"""Prefix reuse: the KV a sequence computed serves later prompts that start with the same tokens.

The KV cache holds one slot per sequence, `max_len` contiguous positions (specrl/models/kv_cache.py;
consecutive slots are read as one view, the decode fast path), so an entry of this cache is a slot:

- a running sequence's slot holds the KV of the positions it has computed;
- a finished sequence's slot keeps its KV until a new sequence needs the slot. Admission takes a
  free slot whose kept KV it reuses (in place: nothing to copy), else an empty one, else the least
  recently used; a running sequence's slot is never taken, so eviction cannot touch what it reads.

A new context is compared with every slot's tokens (at most max_batch of them) and reuses the
longest common prefix: in place, or copied into its own slot position rows [layers, KVH, r, D] of
the target's KV and the drafter's. Measured on SmolLM2-135M fp32 (AMD EPYC, AVX2, one core): 1,000
positions cost 7 ms to copy and 3.9 s to recompute. A radix tree or hashed blocks pay when
entries are many blocks shared by reference (block tables in the attention); over at most
max_batch slots a scan of list slices costs tens of microseconds.

What is reused leaves a sequence in the state its own prefill would have (greedy outputs do not
change; the drafter reads the same features):
- only KV of the weights serving now: every swap starts a new epoch, and nothing of an older one
  is read again. A "drain" swap's old sequences keep running on their KV, but are no source for
  new ones; an interrupt's KV recompute goes through placement again.
- at most LCP - 1 positions, and no more than the source's drafter consumed: the sequence computes
  position r itself, which gives its first token's logits and the target feature at r that its
  drafter needs next (drafter index j holds (feature at j, token at j+1), so the drafter's KV at
  j < r is the source's).
- a context that another sequence is prefilling now (the n sequences of an n > 1 request, a GRPO
  group) waits for that prefill instead of computing the same positions beside it, when waiting
  saves at least WAIT_MIN_TOKENS.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from specrl.engine.outputs import EngineStats
from specrl.engine.sequence import Sequence, Status
from specrl.models.kv_cache import KVCache

WAIT_MIN_TOKENS = 16  # a smaller saving is not worth a step's wait (one decode step costs about as much)


@dataclass
class Entry:
    """A free slot's kept KV: target KV at positions 0..len(tokens)-1 of `tokens`, the drafter's
    at 0..drafted-1, computed in the current epoch; `used`: the LRU clock of its last write or read."""

    tokens: list[int]
    drafted: int
    used: int


class PrefixCache:
    def __init__(self, caches: list[KVCache], stats: EngineStats, *, drafter: bool):
        """caches: the target's KV cache and, with a drafter, the drafter's (same slots, copied
        together); stats: where prefix_cache_queries / _hits are counted."""
        self.caches, self.stats, self.drafter = caches, stats, drafter
        self.entries: dict[int, Entry] = {}  # free slots (and slots admitted but not placed yet) -> kept KV
        self.epoch = 0
        self._placed: dict[int, tuple[Sequence, int]] = {}  # slot -> (its running sequence, epoch of its KV)
        self._clock = itertools.count()

    def new_epoch(self) -> None:
        """The weights changed: nothing computed so far may be reused."""
        self.epoch += 1
        self.entries.clear()

    def choose_slot(self, seq: Sequence, free: list[int], running: list[Sequence]) -> int:
        """The free slot to admit `seq` into: the one whose kept KV it reuses most, when it reuses at least
        as much of that entry as it would overwrite (it continues it: the next turn of a conversation) and no
        running sequence offers more; else an empty slot (lowest first: batches stay consecutive); else the
        least recently used one. Two prompts that share only a short head (a chat template's first tokens
        before different system prompts) each keep their own entry: the head is copied (`place`), not
        taken in place at the cost of the other prompt's KV."""
        context = seq.context_ids(0, seq.prefill_end)
        slot, kept = _best(context, [(s, self.entries[s].tokens, self.entries[s].drafted)
                                     for s in free if s in self.entries])
        _, live = _best(context, self._live(seq, running))
        if (kept > 0 and kept >= max(live, self._in_flight(seq, context, running))
                and kept >= len(self.entries[slot].tokens) - kept):
            return slot
        empty = [s for s in free if s not in self.entries]
        return min(empty) if empty else min(free, key=lambda s: self.entries[s].used)

    def place(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Before the first prefill chunk of `seq` (a new request, or a KV recompute): reuse the
        longest cached prefix of its context, copied into its slot; sets num_computed (and
        draft_start) to the positions reused. False: another sequence is prefilling more of it;
        wait for that, nothing changed."""
        context = seq.context_ids(0, seq.prefill_end)
        owned = {s.slot for s in running if s is not seq}
        kept = sorted(((s, e.tokens, e.drafted) for s, e in self.entries.items() if s not in owned),
                      key=lambda source: source[0] != seq.slot)  # on a tie its own slot: nothing to copy
        source, reused = _best(context, kept + self._live(seq, running))
        if self._in_flight(seq, context, running) >= reused + WAIT_MIN_TOKENS:
            return False
        if reused > 0 and source != seq.slot:
            self._copy(source, seq.slot, reused)
            if source in self.entries:
                self.entries[source].used = next(self._clock)
        self.entries.pop(seq.slot, None)
        self._placed[seq.slot] = (seq, self.epoch)
        seq.num_computed = seq.draft_start = reused
        if seq.num_cached_tokens is None:  # a new request (vLLM counts a recompute apart, as a preempted one)
            seq.num_cached_tokens = reused
            self.stats.prefix_cache_queries += seq.prompt_len
            self.stats.prefix_cache_hits += reused
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` ended and frees its slot: keep the KV it computed in this epoch as the slot's entry
        (a sequence never placed leaves the slot's earlier entry as it was)."""
        placed = self._placed.get(seq.slot)
        if placed is None or placed[0] is not seq:
            return
        del self._placed[seq.slot]
        computed = min(seq.num_computed, seq.prompt_len + len(seq.output_ids))
        if placed[1] == self.epoch and computed > 0:
            drafted = min(seq.draft_start, computed) if self.drafter else computed
            self.entries[seq.slot] = Entry(seq.context_ids(0, computed), drafted, next(self._clock))

    def _live(self, seq: Sequence, running: list[Sequence]) -> list[tuple[int, list[int], int]]:
        """(slot, tokens with KV, drafter positions consumed) of the other running sequences placed in this epoch."""
        sources = []
        for other in running:
            if other is not seq and self._placed.get(other.slot) == (other, self.epoch) and other.num_computed:
                computed = min(other.num_computed, other.prompt_len + len(other.output_ids))
                sources.append((other.slot, other.context_ids(0, computed),
                                other.draft_start if self.drafter else computed))
        return sources

    def _in_flight(self, seq: Sequence, context: list[int], running: list[Sequence]) -> int:
        """The most positions of `context` that another sequence's prefill under way will provide
        once it is done (its drafter then lags by the one pending position that LCP - 1 leaves)."""
        return max((common_prefix(context, other.context_ids(0, other.prefill_end)) - 1 for other in running
                    if other is not seq and other.status is Status.PREFILL
                    and self._placed.get(other.slot) == (other, self.epoch)), default=0)

    def _copy(self, source: int, dest: int, positions: int) -> None:
        for cache in self.caches:
            for kv in (cache.k, cache.v):  # [layers, slots, KVH, max_len, D]
                kv[:, dest, :, :positions].copy_(kv[:, source, :, :positions])


def _best(context: list[int], sources: list[tuple[int, list[int], int]]) -> tuple[int, int]:
    """-> (slot, positions reusable) of the source that gives `context` the most (-1, 0: none):
    LCP - 1 (position r is always computed again), at most what the source's drafter consumed."""
    best = (-1, 0)
    for slot, tokens, drafted in sources:
        reusable = min(common_prefix(context, tokens) - 1, drafted)
        if reusable > best[1]:
            best = (slot, reusable)
    return best


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists (bisection over slice equality,
    compared in C)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # a[:lo] == b[:lo]; the answer is at most hi
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
