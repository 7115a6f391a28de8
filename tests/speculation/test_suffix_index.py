"""The suffix drafter index (specrl/speculation/suffix_index.py): exact proposals on hand-made cases, the
C core against its plain-Python twin on random and repetitive inputs, eviction, dedupe, bounds.

Every hand-made case runs on both cores (`core` fixture); the C core's tests skip when the
extension is not built (`pip install -e .` builds it)."""

from __future__ import annotations

import random

import pytest

from specrl.speculation.suffix_index import NATIVE_AVAILABLE, SuffixIndex, orders_for

CORES = [pytest.param(True, id="c", marks=pytest.mark.skipif(not NATIVE_AVAILABLE, reason="extension not built")),
         pytest.param(False, id="python")]


@pytest.fixture(params=CORES)
def native(request):
    return request.param


def index(native, capacity=10_000, **kwargs) -> SuffixIndex:
    return SuffixIndex(capacity, native=native, **kwargs)


def proposal(ix: SuffixIndex, ctx, max_tokens: int, min_confidence: float) -> tuple[list[int], list[float]]:
    """-> (tokens, confidences) of ix's proposal."""
    draft = ix.propose(ctx, max_tokens, min_confidence)
    return draft.tokens, draft.confidences


def test_orders():
    assert orders_for(2, 32) == (2, 32)
    assert orders_for(4, 4) == (4,)


# ---- matching and voting -------------------------------------------------------------------------

def test_most_frequent_continuation_and_confidence(native):
    ix = index(native)
    for key, doc in enumerate([[1, 2, 3, 7], [5, 2, 3, 7], [6, 2, 3, 8], [9, 2, 3, 7, 4]]):
        ix.add(key, doc)
    tokens, conf = proposal(ix, ix.new_request([0, 2, 3]), 8, 0.1)
    assert tokens == [7, 4]
    assert conf == [pytest.approx(3 / 4), 1.0]  # 7 from 3 of 4 occurrences; then only one has a next token


def test_longest_match_wins(native):
    ix = index(native)
    ix.add("long", [1, 2, 3, 4, 50])  # the suffix 2 3 4 matches 3 tokens here
    for key in range(5):
        ix.add(key, [9, 3, 4, 60])  # ... and only 2 tokens here, five times
    assert proposal(ix, ix.new_request([2, 3, 4]), 4, 0.1) == ([50], [1.0])
    assert proposal(ix, ix.new_request([7, 3, 4]), 4, 0.1) == ([60], [pytest.approx(5 / 6)])  # all six at 2


def test_a_proposal_names_its_match_length_and_source(native):
    ix = index(native, own_bonus=2)
    ix.add("doc", [1, 2, 3, 4, 50])
    draft = ix.propose(ix.new_request([9, 2, 3, 4]), 4, 0.1)
    assert (draft.tokens, draft.match_length, draft.own) == ([50], 3, False)
    draft = ix.propose(ix.new_request([8, 5, 6, 7, 8, 5, 6]), 4, 0.1)  # "8 5 6" occurred in its own text
    assert (draft.tokens[:2], draft.match_length, draft.own) == ([7, 8], 3, True)
    ctx = ix.new_request([3, 4, 61, 3, 4])  # own "3 4" (2 + bonus 2) beats the document's "3 4" (2)
    assert (ix.propose(ctx, 1, 0.1).tokens, ix.propose(ctx, 1, 0.1).own) == ([61], True)
    empty = ix.propose(ix.new_request([70, 71]), 4, 0.1)
    assert (empty.tokens, empty.match_length, empty.own) == ([], 0, False)


def test_longest_match_is_found_beyond_the_occurrence_cap_of_shorter_grams(native):
    """A hot 2-gram fills the cap, but the max_match chain still finds the old, longer match."""
    ix = index(native, max_match=4, max_occurrences=4)
    ix.add("old", [10, 11, 12, 13, 77])
    for key in range(20):
        ix.add(key, [key + 100, 12, 13, 88])
    assert proposal(ix, ix.new_request([10, 11, 12, 13]), 2, 0.1) == ([77], [1.0])


@pytest.mark.parametrize("dead_ends, found", [(3, True), (4, False)])
def test_chain_walk_gives_up_after_four_steps_per_occurrence(native, dead_ends, found):
    """Occurrences with no next token (a document's end) cost chain steps: the walk stops after
    4 x max_occurrences steps, so a hot n-gram bounds the work even when it never verifies."""
    ix = index(native, max_occurrences=1)
    ix.add("old", [2, 3, 9])
    for key in range(dead_ends):
        ix.add(key, [key + 10, 2, 3])
    assert proposal(ix, ix.new_request([1, 2, 3]), 1, 0.1) == (([9], [1.0]) if found else ([], []))


def test_a_sampled_draft_follows_one_occurrence_drawn_by_its_votes(native):
    ix = index(native)
    for key, cont in enumerate([[7, 8, 9], [5, 6, 1], [7, 8, 9], [4, 4, 4]]):
        ix.add(key, [1, 2, 3] + cont)
    ctx = ix.new_request([0, 1, 2, 3])
    assert ix.propose(ctx, 3, 0.0).votes is None  # no uniforms: the most voted tokens
    rng, seen = random.Random(5), {}
    for _ in range(4000):
        draft = ix.propose(ctx, 3, 0.0, uniforms=[rng.random() for _ in range(3)])
        seen[tuple(draft.tokens)] = seen.get(tuple(draft.tokens), 0) + 1
    # the first token from the votes 4: 1, 7: 2, 5: 1 (most recent occurrence first), then its occurrences' text
    assert sorted(seen) == [(4, 4, 4), (5, 6, 1), (7, 8, 9)]
    assert seen[(7, 8, 9)] / 4000 == pytest.approx(0.5, abs=0.03) and seen[(5, 6, 1)] / 4000 == pytest.approx(0.25, abs=0.03)
    draft = ix.propose(ctx, 3, 0.0, uniforms=[0.3, 0.0, 0.0])  # 0.3 * 4 votes: past 4's 1, within 7's 2
    assert draft.tokens == [7, 8, 9] and draft.confidences == [0.5, 1.0, 1.0] and draft.sampled
    assert draft.votes == [([4, 7, 5], [0.25, 0.5, 0.25]), ([8], [1.0]), ([9], [1.0])]
    assert ix.propose(ctx, 3, 0.3, uniforms=[0.0, 0.0, 0.0]).tokens == []  # a 1/4 share is below the threshold
    for bad in ([0.5], [0.5, 1.0, 0.2], [-0.1, 0.0, 0.0]):  # too few; outside [0, 1)
        with pytest.raises(ValueError):
            ix.propose(ctx, 3, 0.0, uniforms=bad)


def test_stops_when_confidence_product_falls_below_threshold(native):
    ix = index(native)
    ix.add(0, [1, 2, 3, 4, 5])
    ix.add(1, [1, 2, 3, 6, 7])
    ctx = ix.new_request([1, 2, 3])
    assert proposal(ix, ctx, 8, 0.5) == ([6, 7], [0.5, 1.0])  # tie -> the most recent document
    assert proposal(ix, ctx, 8, 0.51) == ([], [])
    assert proposal(ix, ctx, 1, 0.1) == ([6], [0.5])  # max_tokens
    assert proposal(ix, ctx, 0, 0.1) == ([], [])


def test_own_context_matches_and_runs_on_into_its_draft(native):
    ix = index(native, capacity=0)  # the global index off: own context only
    ctx = ix.new_request([5, 6, 7, 5, 6])
    assert proposal(ix, ctx, 5, 0.1) == ([7, 5, 6, 7, 5], [1.0] * 5)  # a loop keeps drafting


def test_never_the_self_match(native):
    ix = index(native, capacity=0)
    assert proposal(ix, ix.new_request([1, 2, 3]), 4, 0.1) == ([], [])
    ctx = ix.new_request([1, 2])
    ctx.extend([1, 2])  # 1 2 occurred once before the suffix: proposes what followed it
    assert proposal(ix, ctx, 1, 0.1) == ([1], [1.0])


def test_peers_text_so_far_counts_as_the_requests_own(native):
    """Two samples of one prompt: the one ahead drafts for the other before either finishes; a
    peer's occurrence stops where the peer's text ends (only the request's own runs on)."""
    ix = index(native, capacity=0)  # nothing finished yet: no global index
    ahead, behind = ix.new_request([50, 1, 2, 3, 4, 5]), ix.new_request([50, 1, 2])
    assert ix.propose(behind, 8, 0.1).tokens == []  # alone: its own text has no earlier "50 1 2"
    draft = ix.propose(behind, 8, 0.1, peers=[ahead, behind])  # itself among its peers: ignored
    assert (draft.tokens, draft.confidences, draft.match_length, draft.own) == ([3, 4, 5], [1.0] * 3, 3, True)
    other = index(native).new_request([50, 1, 2, 3])
    with pytest.raises(ValueError):
        ix.propose(behind, 8, 0.1, peers=[other])


def test_peers_vote_beside_the_own_text(native):
    ix = index(native, capacity=0)
    a, b = ix.new_request([7, 8, 1]), ix.new_request([7, 8, 2])
    ctx = ix.new_request([5, 7, 8, 1, 3, 7, 8])  # its own "7 8" went on with 1; the peers': 1 and 2
    draft = ix.propose(ctx, 1, 0.0, peers=[a, b])
    assert (draft.tokens, draft.confidences) == ([1], [pytest.approx(2 / 3)])


@pytest.mark.parametrize("doc, context, bonus, expected", [
    ([7, 6, 1, 2, 40], [9, 1, 2, 30, 7, 6, 1, 2], 0, ([40], [1.0])),  # own "1 2" (2) < global "7 6 1 2" (4)
    ([7, 6, 1, 2, 40], [9, 1, 2, 30, 7, 6, 1, 2], 2, ([30], [0.5])),  # 2 + 2 = 4: a tie, one vote each, own first
    ([5, 7, 6, 1, 2, 40], [9, 1, 2, 30, 5, 7, 6, 1, 2], 2, ([40], [1.0])),  # global "5 7 6 1 2" (5) > 2 + 2
    ([7, 6, 1, 2, 40], [6, 1, 2, 30, 7, 6, 1, 2], 2, ([30], [1.0])),  # own "6 1 2" (3) + 2 > 4
])
def test_own_context_match_counts_own_bonus_tokens_longer(native, doc, context, bonus, expected):
    ix = index(native, own_bonus=bonus)
    ix.add(0, doc)
    assert proposal(ix, ix.new_request(context), 1, 0.1) == expected


def test_documents_do_not_run_into_each_other(native):
    ix = index(native)
    ix.add(0, [1, 2])
    ix.add(1, [3, 4])
    assert proposal(ix, ix.new_request([1, 2]), 4, 0.1) == ([], [])  # 1 2 ends its document
    assert proposal(ix, ix.new_request([2, 3]), 4, 0.1) == ([], [])  # "2 3" spans two documents


def test_max_match_caps_the_extension(native):
    ix = index(native, min_match=2, max_match=4)
    ix.add(0, [1, 2, 3, 4, 5, 6, 70])  # matches 5 tokens of the context, counted as 4
    for key in range(3):
        ix.add(key + 1, [9, 3, 4, 5, 6, 80])  # 4 tokens
    assert proposal(ix, ix.new_request([1, 2, 3, 4, 5, 6]), 1, 0.1) == ([80], [0.75])


# ---- the index: eviction, dedupe, zero capacity, bounds ------------------------------------------

def test_eviction_oldest_first_and_evicted_never_proposed(native):
    ix = index(native, capacity=12)  # each 5-token document takes 6 slots: two fit
    ix.add("a", [1, 2, 3, 4, 5])
    ix.add("b", [11, 12, 13, 14, 15])
    assert (ix.documents, ix.tokens, ix.evicted) == (2, 10, 0)
    ix.add("c", [21, 22, 23, 24, 25])
    assert (ix.documents, ix.tokens, ix.evicted) == (2, 10, 1)
    assert proposal(ix, ix.new_request([1, 2]), 3, 0.1) == ([], [])
    assert proposal(ix, ix.new_request([11, 12]), 3, 0.1) == ([13, 14, 15], [1.0] * 3)
    assert proposal(ix, ix.new_request([21, 22]), 3, 0.1) == ([23, 24, 25], [1.0] * 3)


def test_overwritten_slots_are_not_read_as_old_documents(native):
    """After many wraps of a small ring, only the kept documents are ever proposed."""
    rng = random.Random(3)
    ix = index(native, capacity=50)
    docs, drafted = [], 0
    for key in range(200):
        doc = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        docs.append(doc)
        ix.add(key, doc)
        assert ix.tokens + ix.documents <= 50
        kept = docs[len(docs) - ix.documents:]
        assert ix.tokens == sum(len(d) for d in kept)
        ctx = ix.new_request([rng.randrange(6) for _ in range(2)])  # too short to match itself
        draft, _ = proposal(ix, ctx, 4, 0.0)
        if draft:
            drafted += 1
            assert any(_contains(d, ctx.tolist() + draft) for d in kept)
    assert drafted > 50


def _contains(doc: list[int], part: list[int]) -> bool:
    return any(doc[i:i + len(part)] == part for i in range(len(doc) - len(part) + 1))


def test_long_document_keeps_its_tail_within_capacity(native):
    ix = index(native, capacity=1000)
    ix.add("small", [1, 2, 3])
    ix.add("huge", list(range(100_000)))
    assert (ix.documents, ix.tokens, ix.evicted) == (1, 999, 1)
    assert proposal(ix, ix.new_request([99_001, 99_002]), 3, 0.1) == ([99_003, 99_004, 99_005], [1.0] * 3)
    assert proposal(ix, ix.new_request([5, 6]), 3, 0.1) == ([], [])


def test_dedupe_by_key(native):
    ix = index(native, dedupe_keys=2)
    assert ix.add("r1", [1, 2, 3])
    assert not ix.add("r1", [1, 2, 4])
    assert (ix.documents, ix.duplicates) == (1, 1)
    assert proposal(ix, ix.new_request([1, 2]), 2, 0.1) == ([3], [1.0])
    ix.add("r2", [7])
    ix.add("r3", [8])  # the window holds 2 keys: r1 is forgotten
    assert ix.add("r1", [1, 2, 3])
    assert ix.documents == 4


def test_zero_capacity_is_off(native):
    ix = index(native, capacity=0)
    ix.add("a", [1, 2, 3, 4])
    assert (ix.documents, ix.tokens, ix.evicted) == (0, 0, 0)
    assert proposal(ix, ix.new_request([1, 2]), 4, 0.1) == ([], [])


def test_adversarial_repetition_stays_bounded(native):
    prompt = [random.Random(0).randrange(50) for _ in range(300)]
    ix = index(native, capacity=30_000, max_occurrences=8)
    for key in range(10_000 if native else 300):
        ix.add(key, prompt)
    assert ix.tokens + ix.documents <= 30_000
    assert ix.documents == 30_000 // 301
    ctx = ix.new_request(prompt[:100])
    assert proposal(ix, ctx, 16, 0.1) == (prompt[100:116], [1.0] * 16)


@pytest.mark.skipif(not NATIVE_AVAILABLE, reason="extension not built")
def test_a_full_index_stays_within_its_reserved_bytes():
    """Twice the capacity of varied and of repeated traffic: the RSS grows by what the C core
    reserved (`reserved_bytes`, the bound `bench index` reports), not with the traffic."""
    psutil = pytest.importorskip("psutil")
    capacity = 2_000_000
    rng = random.Random(0)
    varied = [[rng.randrange(49152) for _ in range(300)] for _ in range(100)]
    rss = psutil.Process().memory_info().rss
    ix = index(True, capacity=capacity)
    for key in range(2 * capacity // 301):
        ix.add(key, varied[key % 100] if key % 2 else varied[0])
    grown = psutil.Process().memory_info().rss - rss
    assert ix.tokens + ix.documents <= capacity and ix.evicted > 0
    assert ix.reserved_bytes == 4 * capacity + 2 * 4 * (capacity + (1 << 21))
    assert grown <= 1.1 * ix.reserved_bytes


def test_rejects_bad_tokens_and_foreign_contexts(native):
    ix = index(native)
    with pytest.raises(ValueError):
        ix.add("neg", [1, -1, 2])
    with pytest.raises(ValueError):
        ix.new_request([2**31])
    assert ix.documents == 0
    assert ix.add("neg", [1, 2])  # a failed add did not record its key
    other = index(native)
    with pytest.raises(ValueError):
        ix.propose(other.new_request([1, 2]), 4, 0.1)
    for bad in ({"capacity": -1}, {"min_match": 1}, {"min_match": 5, "max_match": 4}, {"max_occurrences": 0},
                {"own_bonus": -1}):
        with pytest.raises(ValueError):
            index(native, **bad)


# ---- the C core == the Python twin ---------------------------------------------------------------

def _workload(seed: int, vocab: int, repeat: float):
    """Documents and (prefix, extensions) contexts: random, or copies of a few sources."""
    rng = random.Random(seed)
    sources = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 80))] for _ in range(4)]

    def text(n: int) -> list[int]:
        if rng.random() < repeat:
            src = rng.choice(sources)
            start = rng.randrange(len(src))
            return (src[start:] + src)[:n]
        return [rng.randrange(vocab) for _ in range(n)]

    return rng, text


@pytest.mark.skipif(not NATIVE_AVAILABLE, reason="extension not built")
@pytest.mark.parametrize("seed, vocab, repeat, capacity, max_occ", [
    (0, 4, 0.0, 400, 8), (1, 30, 0.7, 300, 4), (2, 200, 0.9, 2000, 64), (3, 3, 0.5, 64, 2), (4, 12, 0.8, 0, 16),
    (5, 500, 0.6, 64, 2),  # 64 buckets for ~60 kept positions of a large vocabulary: hash collisions
])
def test_extension_equals_twin(seed, vocab, repeat, capacity, max_occ):
    rng, text = _workload(seed, vocab, repeat)
    kwargs = dict(min_match=2, max_match=rng.choice([2, 5, 16, 32]), max_occurrences=max_occ,
                  own_bonus=rng.choice([0, 2, 5]))
    c, py = SuffixIndex(capacity, native=True, **kwargs), SuffixIndex(capacity, native=False, **kwargs)
    compared = drafted = 0
    peers_c, peers_py = [], []
    for round_ in range(60):
        doc = text(rng.randrange(0, 120))
        c.add(round_, doc)
        py.add(round_, doc)
        assert (c.documents, c.tokens, c.evicted) == (py.documents, py.tokens, py.evicted)
        prefix = text(rng.randrange(0, 40))
        ctx_c, ctx_py = c.new_request(prefix), py.new_request(prefix)
        peers_c.append(ctx_c)
        peers_py.append(ctx_py)
        for _ in range(6):
            more = text(rng.randrange(1, 30))
            ctx_c.extend(more)
            ctx_py.extend(more)
            k, threshold = rng.choice([1, 4, 16]), rng.choice([0.0, 0.1, 0.5])
            n_peers = rng.choice([0, 0, 1, 3])  # the last contexts made (itself among them: ignored)
            uniforms = [rng.random() for _ in range(k)] if rng.random() < 0.5 else None  # a sampled draft
            got = c.propose(ctx_c, k, threshold, peers_c[-n_peers:] if n_peers else [], uniforms)
            assert got == py.propose(ctx_py, k, threshold, peers_py[-n_peers:] if n_peers else [], uniforms)
            compared += 1
            drafted += len(got.tokens)
    assert ctx_c.tolist() == ctx_py.tolist()
    assert drafted > compared // 4  # the workload drafts, so equality means something
