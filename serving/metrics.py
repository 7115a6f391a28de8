"""Prometheus metrics: vLLM's spec-decode names (existing dashboards work) plus ours.

Engine counters are read at scrape time from the serving loop's `stats` and `telemetry` (nothing is
added to the decode path); request latencies are observed by the HTTP layer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specrl.telemetry import token_use
from specrl.weights.object_store import Pulls

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class ServerMetrics:
    def __init__(self, loop):
        self.registry = CollectorRegistry()
        self.requests = Counter("specrl_requests", "Finished HTTP generation requests", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("specrl_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("specrl_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.swaps = Counter("specrl_weight_swaps", "Weight swaps", ["role", "result"], registry=self.registry)
        self.pulls = _Pulls(self.registry)
        self.registry.register(_LoopCollector(loop))


class _Pulls(Pulls):
    """`weights.object_store.pull`'s counts, also on /metrics: specrl_weight_pulls_total{source, outcome}."""

    def __init__(self, registry):
        super().__init__()
        self.counter = Counter("specrl_weight_pulls", "Where a swap's weights came from: source local, object "
                               "(Ray's object store) or durable; outcome ok, missing, corrupt, failed",
                               ["source", "outcome"], registry=registry)

    def count(self, source: str, outcome: str) -> None:
        super().count(source, outcome)
        self.counter.labels(source, outcome).inc()


class _LoopCollector:
    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        stats = self.loop.stats
        spec = stats.spec
        yield CounterMetricFamily("vllm:spec_decode_num_drafts", "Verify steps that drafted", value=spec.num_drafts)
        yield CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed",
                                  value=spec.num_draft_tokens)
        yield CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=spec.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by position",
                                      labels=["position"])
        for position, count in enumerate(spec.num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        by_proposer = {name: CounterMetricFamily(f"specrl_spec_decode_{name}", doc, labels=["proposer"]) for name, doc in (
            ("num_drafts", "Verify steps that drafted, by proposer (head, suffix)"),
            ("num_draft_tokens", "Draft tokens proposed, by proposer"),
            ("num_accepted_tokens", "Draft tokens accepted, by proposer"))}
        for proposer, counts in sorted(stats.by_proposer.items()):
            for name, family in by_proposer.items():
                family.add_metric([proposer], getattr(counts, name))
        yield from by_proposer.values()
        yield CounterMetricFamily("specrl_generation_tokens", "Tokens generated", value=stats.generated_tokens)
        yield CounterMetricFamily("specrl_decode_seconds", "Wall time of decode steps",
                                  value=stats.decode_seconds)
        yield CounterMetricFamily("specrl_plain_equivalent_seconds",
                                  "What plain decoding would have taken for the same tokens (the engine's cost model); "
                                  "over specrl_decode_seconds: the estimated speed-up",
                                  value=stats.plain_equivalent_seconds)
        yield CounterMetricFamily("specrl_verify_steps", "Verify steps summed over sequences (k = 0 included)",
                                  value=spec.num_steps)
        yield CounterMetricFamily("specrl_prompt_tokens", "Prompt tokens admitted", value=stats.prompt_tokens)
        # vLLM's prefix-cache counters, in prompt tokens of new requests (both backends)
        yield CounterMetricFamily("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens whose KV the prefix cache provided",
                                  value=stats.prefix_cache_hits)
        versions = GaugeMetricFamily("specrl_weight_version_info", "Weight versions serving (value 1)",
                                     labels=["role", "version"])
        versions.add_metric(["policy", self.loop.target_version], 1)
        versions.add_metric(["drafter", self.loop.drafter_version], 1)
        yield versions
        info = GaugeMetricFamily("specrl_engine_info", "What serves (value 1): backend, dtype and why",
                                 labels=sorted(self.loop.info))
        info.add_metric([self.loop.info[k] for k in sorted(self.loop.info)], 1)
        yield info
        yield GaugeMetricFamily("specrl_requests_running", "Requests in the running batch",
                                value=self.loop.num_running)
        yield GaugeMetricFamily("specrl_requests_waiting", "Requests waiting for a slot",
                                value=self.loop.num_waiting)
        telemetry = self.loop.telemetry
        if telemetry is not None:
            yield CounterMetricFamily("specrl_telemetry_records_sent", "Event records written", value=telemetry.sent)
            yield CounterMetricFamily("specrl_telemetry_records_dropped", "Event records dropped",
                                      value=telemetry.dropped)
            yield GaugeMetricFamily("specrl_telemetry_records_queued", "Event records waiting to be sent",
                                    value=telemetry.queued)
        # The effective-token yield, the server's half: every token computed, by use; and records
        # Redis lost in a restart after accepting them (specrl/telemetry/token_use.py).
        uses = CounterMetricFamily(token_use.FAMILY, token_use.DOC, labels=["use"])
        for use, count in token_use.server_uses(stats, telemetry).items():
            uses.add_metric([use], count)
        yield uses
        if telemetry is not None:
            yield CounterMetricFamily("specrl_telemetry_records_lost", "Event records Redis accepted, then lost in "
                                      "a restart", value=getattr(telemetry, "lost", 0))
