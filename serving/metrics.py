"""Prometheus metrics: vLLM's spec-decode names (existing dashboards work) plus ours.

Engine counters are read at scrape time from the engine loop's `stats` (nothing is added to the decode
path); request latencies are observed by the HTTP layer.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48)


class ServerMetrics:
    def __init__(self, engine, sink=None):
        self.registry = CollectorRegistry()
        self.requests = Counter("specrl_requests", "Finished HTTP generation requests", ["endpoint", "status"],
                                registry=self.registry)
        self.ttft = Histogram("specrl_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("specrl_inter_token_latency_seconds", "Time between streamed tokens",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.swaps = Counter("specrl_weight_swaps", "Weight swaps", ["role", "result"], registry=self.registry)
        self.registry.register(_EngineCollector(engine, sink))


class _EngineCollector:
    def __init__(self, engine, sink):
        self.engine, self.sink = engine, sink

    def collect(self):
        stats = self.engine.stats
        yield CounterMetricFamily("vllm:spec_decode_num_drafts", "Verify steps that drafted", value=stats.drafts)
        yield CounterMetricFamily("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", value=stats.draft_tokens)
        yield CounterMetricFamily("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=stats.accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens by position",
                                      labels=["position"])
        for position, count in enumerate(stats.accepted_per_position):
            per_pos.add_metric([str(position)], count)
        yield per_pos
        yield CounterMetricFamily("specrl_generation_tokens", "Tokens generated", value=stats.generated_tokens)
        yield CounterMetricFamily("specrl_verify_steps", "Verify steps summed over sequences (k = 0 included)",
                                  value=stats.steps)
        yield CounterMetricFamily("specrl_prompt_tokens", "Prompt tokens admitted", value=stats.prompt_tokens)
        versions = GaugeMetricFamily("specrl_weight_version_info", "Weight versions serving (value 1)",
                                     labels=["role", "version"])
        versions.add_metric(["policy", self.engine.target_version], 1)
        versions.add_metric(["drafter", self.engine.drafter_version], 1)
        yield versions
        yield GaugeMetricFamily("specrl_requests_running", "Requests in the running batch",
                                value=self.engine.num_running)
        yield GaugeMetricFamily("specrl_requests_waiting", "Requests waiting for a slot",
                                value=self.engine.num_waiting)
        sink = self.sink
        if sink is not None:
            yield CounterMetricFamily("specrl_telemetry_records_sent", "Event records written",
                                      value=getattr(sink, "sent", getattr(sink, "emitted", 0)))
            yield CounterMetricFamily("specrl_telemetry_records_dropped", "Event records dropped",
                                      value=getattr(sink, "dropped", 0))
            yield GaugeMetricFamily("specrl_telemetry_records_queued", "Event records waiting to be sent",
                                    value=getattr(sink, "queued", 0))
