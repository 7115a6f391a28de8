"""`specrl bench index`: what the suffix index costs, at the size of a busy replica and under
adversarial traffic.

Documents are real token ids: the model's tokenizer over the prompt mix (every domain, both
splits, chat-templated), prompts joined in a seeded order until a document holds `doc_tokens`
tokens, so the index sees the templates real traffic repeats. Each scenario fills a fresh index
of `--suffix-capacity` tokens (default: room for every document, so 10k documents are 10k cached
requests; the server's own default is 1M), one `add` per document (its time kept), then times
`propose` (K up to 16, minimum confidence 0.1: the server's settings) for `requests` request
contexts, each a prompt followed by half a document's worth of one of the scenario's documents (a
request partway through an answer the index holds), one at a time (per sequence) and eight at a
time (what one engine step at B=8 asks):

  - mixed: `documents` different documents (10k x 300 tokens: 3M, three times the server's index);
  - repeated: one document added `documents` times under different keys (one prompt repeated 10k
    times: every gram is as hot as it can be, the chain walks' worst case);
  - long: one document of twice the capacity (a very long output: the ring keeps its last tokens).

Memory: the process's RSS growth over each scenario (its index and contexts) against the index's
reserved bound (`SuffixIndex.reserved_bytes`). Without the C core (`native` false in the report)
the Python twin runs: slower, and its lists take several times the bound.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from pathlib import Path

import psutil

from specrl.apps.flags import COMMON, add_settings, settings_from
from specrl.config import Settings
from specrl.errors import InvalidRequestError

MAX_TOKENS = 16  # the server's suffix_max_tokens default: the longest draft a proposal may make
MIN_CONFIDENCE = 0.1
STEP_ROWS = 8  # proposals one engine step at max_batch 8 asks for


def register(sub) -> None:
    p = sub.add_parser("index", help="suffix index cost: add and propose times (p50/p99), memory, adversarial traffic")
    p.add_argument("--documents", type=int, default=10_000, help="documents per scenario (default 10000)")
    p.add_argument("--doc-tokens", type=int, default=300, help="tokens per document (default 300)")
    p.add_argument("--requests", type=int, default=2000, help="request contexts proposed for (default 2000)")
    p.add_argument("--out", default=None, help="report directory (default <home>/reports/bench-index-<time>)")
    add_settings(p, *COMMON, "model", "suffix_capacity")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    for name in ("documents", "doc_tokens", "requests"):
        if getattr(args, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    # default: room for every document (each takes its length + 1 slots), 10k cached requests
    if args.suffix_capacity is None:
        args.suffix_capacity = args.documents * (args.doc_tokens + 1)
    settings = settings_from(args)
    if settings.suffix_capacity < 1:
        raise InvalidRequestError("--suffix-capacity must be at least 1 token to measure an index")
    run_index_bench(settings, args.documents, args.doc_tokens, args.requests, args.out)
    return 0


def run_index_bench(settings: Settings, documents: int, doc_tokens: int, requests: int,
                    out_dir: str | None) -> dict:
    """Run the three scenarios; print a table; write bench-index.json and .png -> the result."""
    from specrl.apps.bench.backends import machine_record, save_report
    from specrl.speculation.suffix_index import NATIVE_AVAILABLE

    prompts = _prompt_tokens(settings)
    rng = random.Random(settings.seed)
    docs = [_document(prompts, doc_tokens, rng) for _ in range(documents)]
    scenarios = {"mixed": docs, "repeated": [docs[0]] * documents,
                 "long": [_document(prompts, 2 * settings.suffix_capacity, rng)]}
    rows = {name: _scenario(name, scenario, _contexts(prompts, scenario, requests, doc_tokens // 2, rng),
                            settings.suffix_capacity) for name, scenario in scenarios.items()}
    result = {"command": "specrl bench index", "model": settings.model, "machine": machine_record(),
              "native": NATIVE_AVAILABLE, "capacity_tokens": settings.suffix_capacity, "documents": documents,
              "doc_tokens": doc_tokens, "requests": requests, "max_tokens": MAX_TOKENS,
              "min_confidence": MIN_CONFIDENCE, "scenarios": rows}
    save_report(result, "bench-index", out_dir, settings.home, _print_table, _plot)
    return result


def _prompt_tokens(settings: Settings) -> list[list[int]]:
    """Every prompt of the mix, chat-templated, as token ids (the settings' model's tokenizer)."""
    from transformers import AutoTokenizer

    from specrl.assets import resolve_model
    from specrl.data import chat_token_ids, load_prompts

    return chat_token_ids(AutoTokenizer.from_pretrained(resolve_model(settings.model, settings.home)), load_prompts())


def _document(prompts: list[list[int]], tokens: int, rng: random.Random) -> list[int]:
    doc: list[int] = []
    while len(doc) < tokens:
        doc += rng.choice(prompts)
    return doc[:tokens]


def _contexts(prompts: list[list[int]], documents: list[list[int]], n: int, length: int,
              rng: random.Random) -> list[list[int]]:
    """n request contexts: a prompt, then `length` tokens of one of the scenario's documents, ending
    in its second half (a request partway through an answer the index holds; a long document's
    second half is what the ring keeps)."""
    out = []
    for _ in range(n):
        doc = rng.choice(documents)
        end = rng.randint(len(doc) // 2, len(doc))
        out.append(rng.choice(prompts) + doc[max(0, end - length): end])
    return out


def _scenario(name: str, documents: list[list[int]], contexts: list[list[int]], capacity: int) -> dict:
    from specrl.speculation.suffix_index import SuffixIndex

    gc.collect()
    rss_before = psutil.Process().memory_info().rss
    index = SuffixIndex(capacity)
    add_us = []
    for i, doc in enumerate(_progress(documents, f"{name}: adding")):
        started = time.perf_counter()
        index.add((name, i), doc)
        add_us.append((time.perf_counter() - started) * 1e6)
    requests = [index.new_request(ctx) for ctx in contexts]
    propose_us, drafted = [], []
    for ctx in _progress(requests, f"{name}: proposing"):
        started = time.perf_counter()
        draft = index.propose(ctx, MAX_TOKENS, MIN_CONFIDENCE)
        propose_us.append((time.perf_counter() - started) * 1e6)
        drafted.append(len(draft.tokens))
    step_us = []
    for b in range(0, len(requests) - STEP_ROWS + 1, STEP_ROWS):
        started = time.perf_counter()
        for ctx in requests[b: b + STEP_ROWS]:
            index.propose(ctx, MAX_TOKENS, MIN_CONFIDENCE)
        step_us.append((time.perf_counter() - started) * 1e6)
    rss_growth = psutil.Process().memory_info().rss - rss_before
    row = {"documents_added": len(documents), "documents_kept": index.documents, "tokens_kept": index.tokens,
           "evicted": index.evicted, "add_us": _percentiles(add_us), "propose_us": _percentiles(propose_us),
           "step_of_8_us": _percentiles(step_us) if step_us else None,
           "drafted_tokens_mean": statistics.fmean(drafted), "rss_growth_bytes": rss_growth,
           "reserved_bytes": index.reserved_bytes, "propose_us_values": sorted(propose_us)}
    del index, requests
    return row


def _percentiles(values: list[float]) -> dict:
    from specrl.loadtest.report import percentile

    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values), "n": len(values)}


def _progress(items: list, label: str):
    from tqdm import tqdm

    return tqdm(items, desc=f"bench index: {label}", leave=False, mininterval=1.0)


def _print_table(result: dict) -> None:
    from specrl.apps.bench.backends import machine_line

    print(f"machine: {machine_line(result['machine'])}; {'C core' if result['native'] else 'Python twin'}; "
          f"capacity {result['capacity_tokens']} tokens; K <= {result['max_tokens']}, "
          f"min confidence {result['min_confidence']}")
    print(f"{'scenario':<9} {'kept':>6} {'tokens':>8} {'add p50':>8} {'p99':>7} {'propose p50':>11} {'p99':>7} "
          f"{'max':>7} {'step of 8 p50':>13} {'p99':>7} {'drafted':>7} {'RSS MiB':>8} {'bound MiB':>9}")
    for name, r in result["scenarios"].items():
        step = r["step_of_8_us"] or {"p50": float("nan"), "p99": float("nan")}
        print(f"{name:<9} {r['documents_kept']:>6} {r['tokens_kept']:>8} {r['add_us']['p50']:>6.1f}us "
              f"{r['add_us']['p99']:>5.1f}us {r['propose_us']['p50']:>9.1f}us {r['propose_us']['p99']:>5.1f}us "
              f"{r['propose_us']['max']:>5.0f}us {step['p50']:>11.1f}us {step['p99']:>5.1f}us "
              f"{r['drafted_tokens_mean']:>7.2f} {r['rss_growth_bytes'] / 2**20:>8.1f} "
              f"{r['reserved_bytes'] / 2**20:>9.1f}")


def _plot(result: dict, path: Path) -> None:
    """Propose time per sequence: its distribution (CDF) per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in result["scenarios"].items():
        values = r["propose_us_values"]
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("propose time per sequence (us, log)")
    ax.set_ylabel("share of proposals")
    ax.set_title(f"suffix index, {result['documents']} documents x {result['doc_tokens']} tokens "
                 f"({'C core' if result['native'] else 'Python twin'})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
