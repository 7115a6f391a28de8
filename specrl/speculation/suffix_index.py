"""A nonparametric drafter: propose what earlier text continued the current suffix with.

`SuffixIndex` searches two sources at once for the longest suffix of a request's context
(its prompt + output so far, token ids) that occurred before:
  - a bounded GLOBAL index over recent documents (finished requests' prompt + output, or
    records from other replicas), evicted oldest document first;
  - the request's OWN context, held in a `RequestContext` that the engine extends as tokens
    are committed (a trivial match of the context against its own end never counts).
It then drafts the most frequent continuation, token by token, with a confidence per token.

The algorithm (the C extension `_suffix_index` and the plain-Python twin here are the same
algorithm and give the same proposals; the twin is the fallback when the extension is not built):

Storage. The global tokens live in a ring of `capacity_tokens` slots (each document takes its
length + 1: a separator after it); a document longer than the ring keeps its last tokens.
For each gram length k in `orders` = (min_match, max_match) a hash chain links every position
to the previous position whose k tokens ending there hash to the same bucket (zlib's head/prev
arrays). Chains are walked most recent first and stop at the eviction horizon (the start of the
oldest kept document), so evicting costs nothing but moving the horizon. A request context
keeps the same chains over its own tokens. Why a max_match chain as well: the capped walk of a
hot short gram only sees its most recent occurrences; an old exact repeat (the same question
asked again after other traffic) is found through its long gram. Measured by re-asking 50
earlier prompts after 200 responses: 15.6 tokens per verify step at k <= 16 with both chains,
14.0 with the min_match chain alone; intermediate orders (4, 8, 16) changed nothing there nor on
fresh traffic, at 1 extra chain of memory each.

Match. For k from the longest order down: walk the chain of the context's last k tokens in each
source, verify the tokens (hash buckets collide), skip occurrences with no next token, extend
each verified occurrence backwards up to max_match, and stop after `max_occurrences` verified
occurrences per source (or 4x that many chain steps), so a hot n-gram costs a bounded walk. The
first order with any occurrence gives each source its longest match length.

Combine. Each source's longest match is found separately; an own-context match counts
`own_bonus` tokens longer (default 2), the longer wins, and on a tie both sources' occurrences of
their longest length vote, one vote each. Why: in exact greedy simulation over 200 SmolLM2
responses, tokens per verify step at k <= 16 were 1.547 for plain longest-wins, 1.573 with a
bonus of 2 (the same with 4, or with a strict own-first rule), 1.570 with 1, 1.543 pooling
both sources' longest matches, 1.558 counting own votes 4x at equal length; own context alone
1.325, global alone 1.218. The request's own text predicts its continuation better than another
request's text matching a little longer; a bonus (not own-first) still lets a much longer global
match win (a repeated template).

Peers. Requests that run at the same time with the same prompt (the n samples of one request,
a GRPO group) are each other's best evidence, long before any of them finishes and joins the
global index. `propose(ctx, ..., peers)` searches the peers' text so far as part of the own
source: the request's own occurrences first, then each peer's, max_occurrences in all; a peer's
occurrence votes while the peer has a next token (it cannot run on into this request's draft).

Draft. Each step, every live occurrence votes for the token after it (an own-context occurrence
may run on into the tokens drafted so far: a repeating loop keeps drafting); the most voted
token wins (ties: the token seen first, own before global, most recent first), its confidence is
its votes / the occurrences that have a next token (a document's end has none); occurrences that
disagree drop out. Drafting stops before the running product of confidences falls below
`min_confidence`, when no occurrence is left, or at `max_tokens`. A proposal (`SuffixDraft`) also
names the longest match length among the voting occurrences and whether the request's own text
is among them: how often its tokens are accepted depends on both (`suffix_acceptance.py`).

Sampled drafts. For a request that samples, a most-voted draft d* is a one-hot q: verification
accepts it with probability p(d*) (about 0.18 a token on temperature-1 rollouts). Given uniforms,
each step instead draws its token from the vote distribution v (inverse CDF over the counts in
first-seen order), and the occurrences that voted for it run on: the draft follows one
occurrence's continuation, chosen with probability proportional to its votes. Rejection sampling
with q = v is still exact (verify.py) and accepts with probability sum_x min(p(x), v(x)), which
gains where many voters sample the same policy (v then approximates p). Measured offline on format
tasks at temperature 1 (SmolLM2, held-out GRPO groups of 4, the index holding 96 other rollouts):
first tokens accepted 0.268 drawn against 0.253 most-voted; the matches are few (sum v^2 0.79)
while p is spread. The proposal returns every step's v (`SuffixDraft.votes`) for the verifier's q
and its residual.

Costs (n = context length, K = draft length, O = max_occurrences, M = max_match,
R = len(orders)), measured with the C core at 10k documents of 300 tokens on one EPYC core:
  add(key, tokens)      O(len(tokens) * R), plus O(1) per evicted document: 14 us for 300 tokens.
  ctx.extend(tokens)    O(len(tokens) * R) amortised (the context's bucket table doubles): 0.15 us
                        per token.
  propose(ctx, K, c)    O(R * O * M) to match, then O(K * O) to draft; independent of n and of
                        how many times a gram occurred: 8 us p50, 22 us p99 for K = 16 (the
                        twin: 80 us / 270 us at 1k documents).
Memory: reserved up front (pages are touched as the ring fills): 4 bytes per ring slot for
tokens plus, per order, 4 bytes of chain and 4 bytes per bucket head (one head per slot, rounded
up to a power of two): 68 MB RSS at 3.01M slots (10k documents of 300 tokens).

Thread safety: calls are serialised by a lock (the engine proposes while a reader thread adds).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Hashable, Iterable, Protocol, Sequence

SEPARATOR = -1  # ring slot after each document; no token id equals it
MASK = (1 << 64) - 1
BASE = 0x100000001B3  # polynomial hash over token ids + 1, mod 2**64
MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: bucket = top bits of hash * MIX
MAX_TOKEN = (1 << 31) - 2
MIN_BITS = 6  # smallest bucket table: 64 heads


def orders_for(min_match: int, max_match: int) -> tuple[int, ...]:
    """The gram lengths that get a hash chain: min_match and max_match."""
    return (min_match, max_match) if max_match > min_match else (min_match,)


def _bits_for(slots: int) -> int:
    """log2 of the bucket table size for `slots` positions: at least one head per position."""
    return max(MIN_BITS, (max(slots, 1) - 1).bit_length())


def _bucket(gram_hash: int, bits: int) -> int:
    return ((gram_hash * MIX) & MASK) >> (64 - bits)


def _gram_hash(prefix: list[int], end: int, k: int, power: int) -> int:
    """Hash of the k tokens before `end`, from prefix hashes (power = BASE**k mod 2**64)."""
    return (prefix[end] - prefix[end - k] * power) & MASK


def _prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """P[i] = hash of tokens[:i]; the gram tokens[i:j] hashes to P[j] - P[i] * BASE**(j-i)."""
    out, h = [0], 0
    for t in tokens:
        h = (h * BASE + t + 1) & MASK
        out.append(h)
    return out


def _check_tokens(tokens: Iterable[int]) -> list[int]:
    out = [int(t) for t in tokens]
    for t in out:
        if not 0 <= t <= MAX_TOKEN:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN}], got {t}")
    return out


@dataclass(frozen=True)
class SuffixDraft:
    """One proposal: tokens [K] (target ids), confidences [K] (each token's vote share among the
    occurrences still agreeing), match_length (context tokens the voting occurrences matched; 0: no
    occurrence), own (the request's own context is among the voters). How often a token is accepted
    rises with the match length and is higher for the own context's matches (controller's
    `SuffixAcceptance`). votes: None for a deterministic draft (the most voted token each step);
    for a sampled one ("Sampled drafts" in the module docstring) [K] pairs (ids, shares), the vote
    distribution each token was drawn from (its confidence is its own share)."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    match_length: int = 0
    own: bool = False
    votes: list[tuple[list[int], list[float]]] | None = None

    @property
    def sampled(self) -> bool:
        return self.votes is not None


class RequestContext(Protocol):
    """One request's own tokens (prompt + output so far), made by `SuffixIndex.new_request`.
    The C core's `_suffix_index.Context` and the twin's `_TwinContext` both have this interface."""

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed token ids: O(len(tokens) * len(orders)) amortised."""

    def tolist(self) -> list[int]:
        """The context's token ids."""

    def __len__(self) -> int: ...


class _Params:
    """What the index and its contexts share: the match limits and the hash powers per order."""

    def __init__(self, min_match: int, max_match: int, max_occurrences: int, own_bonus: int):
        self.min_match, self.max_match = min_match, max_match
        self.max_occurrences, self.max_steps = max_occurrences, 4 * max_occurrences
        self.own_bonus = own_bonus
        self.orders = orders_for(min_match, max_match)
        self.powers = [pow(BASE, k, 1 << 64) for k in self.orders]


class _TwinContext:
    """Plain-Python request context: tokens, prefix hashes, and per order a chain over own grams."""

    def __init__(self, params: _Params, owner: "_TwinIndex"):
        self.params, self.owner = params, owner
        self.tokens: list[int] = []
        self.prefix = [0]
        self.bits = MIN_BITS
        self.heads = [[-1] * (1 << self.bits) for _ in params.orders]
        self.prev: list[list[int]] = [[] for _ in params.orders]

    def __len__(self) -> int:
        return len(self.tokens)

    def tolist(self) -> list[int]:
        return list(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for t in _check_tokens(tokens):
            self.tokens.append(t)
            self.prefix.append((self.prefix[-1] * BASE + t + 1) & MASK)
            if len(self.tokens) > (1 << self.bits) // 2:
                self._grow()
            else:
                self._link(len(self.tokens) - 1)

    def gram_hash(self, r: int, end: int) -> int:
        """Hash of the order-r gram ending before `end` (end >= that order's k)."""
        return _gram_hash(self.prefix, end, self.params.orders[r], self.params.powers[r])

    def _link(self, p: int) -> None:
        for r, k in enumerate(self.params.orders):
            if p + 1 >= k:
                b = _bucket(self.gram_hash(r, p + 1), self.bits)
                self.prev[r].append(self.heads[r][b])
                self.heads[r][b] = p
            else:
                self.prev[r].append(-1)

    def _grow(self) -> None:
        """Double the bucket table and relink every position (amortised O(1) per token)."""
        self.bits += 1
        self.heads = [[-1] * (1 << self.bits) for _ in self.params.orders]
        self.prev = [[] for _ in self.params.orders]
        for p in range(len(self.tokens)):
            self._link(p)

    def occurrences(self, query: "_TwinContext", r: int, limit: int) -> list[tuple[int, int]]:
        """(match length, position of the next token) of occurrences of query's order-r suffix
        gram in this context's tokens (query is self: its own earlier text; else a peer's), most
        recent first, each with a next token here, at most `limit` within the step cap."""
        n, m, k, params = len(query.tokens), len(self.tokens), self.params.orders[r], self.params
        tokens, qt = self.tokens, query.tokens
        if n < k or m < k + 1:
            return []
        p = self.heads[r][_bucket(query.gram_hash(r, n), self.bits)]
        found, steps = [], 0
        while p >= 0 and steps < params.max_steps and len(found) < limit:
            steps += 1
            if p < m - 1 and tokens[p - k + 1:p + 1] == qt[n - k:]:
                length = k
                while (length < params.max_match and length < n and p - length >= 0
                       and tokens[p - length] == qt[n - 1 - length]):
                    length += 1
                found.append((length, p + 1))
            p = self.prev[r][p]
        return found


class _TwinIndex:
    """Plain-Python global index (the same algorithm as the C core, `_suffix_index.Index`)."""

    def __init__(self, capacity: int, min_match: int, max_match: int, max_occurrences: int, own_bonus: int):
        self.params = _Params(min_match, max_match, max_occurrences, own_bonus)
        self.capacity = capacity
        self.ring = [SEPARATOR] * capacity
        self.bits = _bits_for(capacity)
        self.heads = [[-1] * (1 << self.bits) if capacity else [] for _ in self.params.orders]
        self.prev = [[-1] * capacity for _ in self.params.orders]
        self.starts: list[int] = []  # start position of each kept document, oldest first
        self.first = 0  # index into starts of the oldest kept document
        self.base = self.end = 0  # kept positions: [base, end)
        self.documents = self.tokens = self.evicted = 0

    def new_context(self) -> _TwinContext:
        return _TwinContext(self.params, self)

    def add(self, tokens: Sequence[int]) -> None:
        tokens = _check_tokens(tokens)
        tokens = tokens[-(self.capacity - 1):] if self.capacity > 1 else []  # the last ones that fit
        if not tokens:
            return
        while self.end + len(tokens) + 1 - self.base > self.capacity:
            self._evict_oldest()
        start = self.end
        prefix = _prefix_hashes(tokens)
        for i, t in enumerate(tokens):
            p = start + i
            self.ring[p % self.capacity] = t
            for r, k in enumerate(self.params.orders):
                if i + 1 >= k:
                    b = _bucket(_gram_hash(prefix, i + 1, k, self.params.powers[r]), self.bits)
                    head = self.heads[r][b]
                    self.prev[r][p % self.capacity] = head if head >= self.base else -1
                    self.heads[r][b] = p
        self.ring[(start + len(tokens)) % self.capacity] = SEPARATOR
        self.end = start + len(tokens) + 1
        self.starts.append(start)
        self.documents += 1
        self.tokens += len(tokens)

    def _evict_oldest(self) -> None:
        start = self.starts[self.first]
        self.first += 1
        nxt = self.starts[self.first] if self.first < len(self.starts) else self.end
        self.tokens -= nxt - start - 1
        self.documents -= 1
        self.evicted += 1
        self.base = nxt
        if self.first > 1024 and self.first * 2 > len(self.starts):
            del self.starts[:self.first]
            self.first = 0

    def occurrences(self, ctx: _TwinContext, r: int) -> list[tuple[int, int]]:
        """(match length, position of the next token) of global occurrences of the context's
        order-r suffix gram, most recent first, within the occurrence and step caps."""
        n, k, params, cap, ring = len(ctx), self.params.orders[r], self.params, self.capacity, self.ring
        if self.documents == 0 or n < k:
            return []
        query = ctx.tokens
        p = self.heads[r][_bucket(ctx.gram_hash(r, n), self.bits)]
        found, steps = [], 0
        while p >= self.base and steps < params.max_steps and len(found) < params.max_occurrences:
            steps += 1
            if (p - k + 1 >= self.base and ring[(p + 1) % cap] != SEPARATOR
                    and all(ring[(p - j) % cap] == query[n - 1 - j] for j in range(k))):
                length = k
                while (length < params.max_match and length < n and p - length >= self.base
                       and ring[(p - length) % cap] == query[n - 1 - length]):
                    length += 1
                found.append((length, p + 1))
            p = self.prev[r][p % cap]
        return found

    def propose(self, ctx: _TwinContext, max_tokens: int, min_confidence: float,
                peers: Sequence[_TwinContext] = (), uniforms: Sequence[float] | None = None
                ) -> tuple[list[int], list[float], int, bool, list | None]:
        if ctx.owner is not self:
            raise ValueError("the context was made by another index (use that index's new_request())")
        if any(not isinstance(peer, _TwinContext) or peer.owner is not self for peer in peers):
            raise ValueError("peers must be contexts made by this index's new_request()")
        if uniforms is not None and len(uniforms) < max_tokens:
            raise ValueError("uniforms must hold at least max_tokens floats")
        own, glob, match = self._match(ctx, [peer for peer in peers if peer is not ctx])
        tokens, confidences, votes = self._draft(ctx, own, glob, max_tokens, min_confidence, uniforms)
        return tokens, confidences, match, bool(own), votes

    def _own_occurrences(self, ctx: _TwinContext, peers: list[_TwinContext], r: int) -> list[tuple[int, tuple]]:
        """The own source's order-r occurrences: the request's text, then each peer's, at most
        max_occurrences in all -> (match length, (context, next-token position))."""
        found = [(length, (ctx, q)) for length, q in ctx.occurrences(ctx, r, self.params.max_occurrences)]
        for peer in peers:
            if len(found) >= self.params.max_occurrences:
                break
            found += [(length, (peer, q)) for length, q in
                      peer.occurrences(ctx, r, self.params.max_occurrences - len(found))]
        return found

    def _match(self, ctx: _TwinContext, peers: list[_TwinContext]) -> tuple[list[tuple], list[int], int]:
        """-> the own source's voting occurrences as (context, next-token position), the global
        ones' next-token positions (each source's longest, the longer (own + own_bonus) wins, both
        on a tie), and the longest match among the voting sources in context tokens (0: none)."""
        own_len, own = _longest(lambda r: self._own_occurrences(ctx, peers, r), len(self.params.orders))
        glob_len, glob = _longest(lambda r: self.occurrences(ctx, r), len(self.params.orders))
        bonus_len = own_len + self.params.own_bonus if own else -1
        best = max(bonus_len, glob_len)
        own, glob = (own if bonus_len == best else []), (glob if glob_len == best else [])
        return own, glob, glob_len if glob else own_len if own else 0

    def _draft(self, ctx: _TwinContext, own: list[tuple], glob: list[int], max_tokens: int,
               min_confidence: float, uniforms: Sequence[float] | None
               ) -> tuple[list[int], list[float], list | None]:
        n, cap, ring = len(ctx), self.capacity, self.ring
        tokens: list[int] = []
        confidences: list[float] = []
        votes: list | None = None if uniforms is None else []
        product = 1.0

        def own_next_token(src: _TwinContext, q: int) -> int:  # the request's text runs on into the draft; a peer's ends
            if src is ctx:
                return src.tokens[q] if q < n else tokens[q - n]
            return src.tokens[q] if q < len(src.tokens) else SEPARATOR

        while len(tokens) < max_tokens and (own or glob):
            own_next = [own_next_token(src, q) for src, q in own]
            glob_next = [ring[q % cap] for q in glob]
            counts: dict[int, int] = {}  # votes per next token, first seen first (own, then global)
            for t in own_next + glob_next:
                if t != SEPARATOR:
                    counts[t] = counts.get(t, 0) + 1
            if not counts:
                break
            total = sum(counts.values())
            if uniforms is None:
                best = max(counts, key=counts.__getitem__)  # the first of the most voted
            else:
                best = _draw(counts, uniforms[len(tokens)] * total)
            confidence = counts[best] / total
            product *= confidence
            if product < min_confidence:
                break
            tokens.append(best)
            confidences.append(confidence)
            if votes is not None:
                votes.append((list(counts), [c / total for c in counts.values()]))
            own = [(src, q + 1) for (src, q), t in zip(own, own_next) if t == best]
            glob = [q + 1 for q, t in zip(glob, glob_next) if t == best]
        return tokens, confidences, votes


def _draw(counts: dict[int, int], bar: float) -> int:
    """The first token, in first-seen order, whose running vote count passes bar (u * total): token
    x with probability counts[x] / total for u uniform in [0, 1); the last one if none passes."""
    seen = 0
    for token, count in counts.items():
        seen += count
        if seen > bar:
            return token
    return token


def _longest(occurrences, n_orders: int) -> tuple[int, list[int]]:
    """The first order, longest first, with any occurrence -> (longest match length, the next-token
    positions (as the occurrences name them) of the occurrences with that length, in order); (-1, [])
    if none."""
    for r in reversed(range(n_orders)):
        found = occurrences(r)
        if found:
            best = max(length for length, _ in found)
            return best, [q for length, q in found if length == best]
    return -1, []


try:
    from specrl.speculation import _suffix_index as _native
except ImportError:  # not built: the twin serves
    _native = None

NATIVE_AVAILABLE = _native is not None


class SuffixIndex:
    """Bounded index of recent documents + per-request contexts; proposes drafts (see module doc).

    capacity_tokens: ring slots for global documents (a document takes its length + 1); 0 turns
      the global index off (own-context matching still works).
    min_match, max_match: suffix lengths searched (2 <= min_match <= max_match).
    max_occurrences: occurrences examined per source, most recent first (bounds proposal cost).
    own_bonus: tokens added to the own context's match length when it competes with the global
      index's (see "Combine" in the module docstring).
    dedupe_keys: how many recent `add` keys are remembered; a key seen among them is skipped.
    native: True for the C extension (ImportError if not built), False for the Python twin,
      None for the extension when it is built.
    """

    def __init__(self, capacity_tokens: int, *, min_match: int = 2, max_match: int = 32, max_occurrences: int = 64,
                 own_bonus: int = 2, dedupe_keys: int = 65536, native: bool | None = None):
        if not (0 <= capacity_tokens < 2**31 and 2 <= min_match <= max_match <= 4096
                and 1 <= max_occurrences <= 2**20 and 0 <= own_bonus <= 2**20 and dedupe_keys >= 0):
            raise ValueError("SuffixIndex needs 0 <= capacity_tokens < 2**31, 2 <= min_match <= max_match <= 4096, "
                             "1 <= max_occurrences <= 2**20, 0 <= own_bonus <= 2**20 and dedupe_keys >= 0")
        if native and _native is None:
            raise ImportError("specrl.speculation._suffix_index is not built (pip install -e . builds it)")
        use_native = _native is not None if native is None else native
        core = _native.Index if use_native else _TwinIndex
        self.native = use_native
        self._core = core(capacity_tokens, min_match, max_match, max_occurrences, int(own_bonus))
        self.capacity_tokens, self.min_match, self.max_match = capacity_tokens, min_match, max_match
        self.max_occurrences, self.own_bonus = max_occurrences, own_bonus
        self.orders = orders_for(min_match, max_match)
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self._dedupe_keys = dedupe_keys
        self._lock = threading.Lock()
        self.duplicates = 0  # adds skipped because their key was seen recently

    def add(self, key: Hashable, tokens: Sequence[int]) -> bool:
        """Add one document (token ids, e.g. prompt + output of a finished request) under a
        caller-given key; a key among the last `dedupe_keys` is skipped. -> False when skipped.
        Cost O(len(tokens) * len(orders)) plus O(1) per evicted document."""
        with self._lock:
            if key in self._keys:
                self.duplicates += 1
                return False
            self._core.add(tokens)  # raises ValueError on a bad token id, before the key is recorded
            if self._dedupe_keys:
                self._keys[key] = None
                if len(self._keys) > self._dedupe_keys:
                    self._keys.popitem(last=False)
            return True

    def new_request(self, tokens: Sequence[int] = ()) -> RequestContext:
        """A context for one request, optionally starting with its prompt; extend it with
        `ctx.extend(token_ids)` as tokens are committed."""
        ctx = self._core.new_context()
        ctx.extend(tokens)
        return ctx

    def propose(self, ctx: RequestContext, max_tokens: int, min_confidence: float = 0.1,
                peers: Sequence[RequestContext] = (), uniforms: Sequence[float] | None = None) -> "SuffixDraft":
        """Draft up to max_tokens after ctx's tokens: K <= max_tokens tokens, the running product of
        their confidences >= min_confidence. peers: contexts of requests running beside this one
        with the same prompt (the n samples of one request, a GRPO group); their text so far
        counts as the request's own ("Peers" in the module docstring). uniforms: at least
        max_tokens floats in [0, 1) to draw a sampled draft ("Sampled drafts"); None: the most
        voted tokens."""
        if uniforms is not None and not all(0.0 <= u < 1.0 for u in uniforms[:max_tokens]):
            raise ValueError("uniforms must be in [0, 1)")
        with self._lock:
            return SuffixDraft(*self._core.propose(ctx, max_tokens, min_confidence, tuple(peers), uniforms))

    @property
    def reserved_bytes(self) -> int:
        """What the C core reserves for the global index at construction, the bound its memory stays
        within however much traffic arrives: 4 bytes a ring slot of tokens, and per order 4 bytes a
        slot of chain and 4 a bucket head (a power of two, at least one a slot). Request contexts
        come on top, each its own tokens' worth. (The twin keeps Python lists: several times more.)"""
        if self.capacity_tokens == 0:
            return 0
        heads = 1 << _bits_for(self.capacity_tokens)
        return 4 * self.capacity_tokens + len(self.orders) * 4 * (self.capacity_tokens + heads)

    @property
    def documents(self) -> int:
        """Documents kept now."""
        return self._core.documents

    @property
    def tokens(self) -> int:
        """Tokens kept now (separators not counted)."""
        return self._core.tokens

    @property
    def evicted(self) -> int:
        """Documents evicted since start."""
        return self._core.evicted


