"""`specrl train-drafter`: the trainer process (signals, logging, assembly)."""

from __future__ import annotations

import logging
import signal
import sys

from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.telemetry import RecordReader, events_stream
from specrl.telemetry.event_log import EventLog
from specrl.trainer.drafter_trainer import DrafterTrainer
from specrl.trainer.publisher import Publisher
from specrl.weights import WeightsStore
from specrl.weights.deployment import DeploymentVersions
from specrl.weights.object_store import DurableStore

GROUP = "drafter"


def build_trainer(settings: Settings) -> DrafterTrainer:
    if not settings.redis_url:
        raise InvalidRequestError("the trainer needs --redis-url (or SPECRL_REDIS_URL)")
    store = WeightsStore(settings.store_path)
    servers = [s for s in settings.servers.split(",") if s]
    reader = RecordReader(settings.redis_url, events_stream(settings.deployment), GROUP, settings.consumer)
    # Replicas follow the deployment's current drafter (announced on Redis): one this trainer does not know too.
    versions = DeploymentVersions(store, settings.redis_url, settings.deployment)
    durable = DurableStore(settings.durable_store) if settings.durable_store else None
    publisher = Publisher(store, servers, settings.admin_token, versions=versions, durable=durable)
    state = settings.home / "trainer" / settings.deployment / f"{settings.consumer}.pt"
    return DrafterTrainer(settings, resolve_model(settings.model, settings.home), reader, store=store,
                          publisher=publisher, state_path=state, events=EventLog(settings.trainer_events_path))


def train_drafter(settings: Settings) -> int:
    """`specrl train-drafter`: the loop until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    run_trainer(settings, lambda: bool(stopping))
    return 0


def run_trainer(settings: Settings, should_stop) -> DrafterTrainer:
    """Build the trainer (resuming from its checkpoint, re-reading its pending records), train until
    should_stop(), then checkpoint and ack. The loop of `specrl train-drafter` and of the Ray actor."""
    trainer = build_trainer(settings)
    logging.getLogger("specrl.trainer").info(
        "event=start deployment=%s consumer=%s objective=%s serving_drafter=%s", settings.deployment,
        settings.consumer, settings.objective, trainer.serving_version)
    trainer.events.write("start", deployment=settings.deployment, consumer=settings.consumer,
                         objective=settings.objective, serving_drafter=trainer.serving_version)
    trainer.run(should_stop, on_step=_metrics(settings.trainer_metrics_port))
    trainer.save_state()
    if trainer.unacked:
        trainer.reader.ack(trainer.unacked)
    return trainer


def _metrics(port: int):
    """Export the trainer's progress, throughput matching and token uses on /metrics when a port is
    given: read at scrape time from the trainer (its `Throughput` is measured on the trainer's thread)."""
    if port <= 0:
        return None
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    start_http_server(port, addr="127.0.0.1", registry=registry)

    def register(trainer: DrafterTrainer) -> None:
        registry.register(_TrainerCollector(trainer))
        hook[0] = None

    hook = [register]
    return lambda trainer: hook[0] and hook[0](trainer)


class _TrainerCollector:
    GAUGES = (("consumer_lag", "Stream entries not yet delivered to the group"),
              ("lag_records", "Records waiting: not yet delivered, or read and queued"),
              ("lag_seconds", "Age of the oldest record waiting (Redis clock; an upper bound)"),
              ("produced_records_per_s", "Records arriving on the stream per second (last 30 s)"),
              ("produced_tokens_per_s", "Tokens arriving on the stream per second (last 30 s)"),
              ("consumed_records_per_s", "Records trained per second (last 30 s)"),
              ("consumed_tokens_per_s", "Positions trained per second (last 30 s)"),
              ("queued", "Examples read and waiting to be trained"), ("heldout", "Held-out examples kept"))
    COUNTERS = (("steps", "Optimizer steps (replays included)"), ("records", "Records trained on (first time)"),
                ("skipped", "Records skipped (unloadable policy version)"),
                ("orphans", "Segments whose earlier segments never arrived"),
                ("expired_records", "Records not trained: older than the age bound when their turn came"),
                ("replay_steps", "Optimizer steps on replayed examples (nothing new to read)"),
                ("replayed_records", "Examples trained again in replay steps"),
                ("features_shipped", "Examples trained on the features their records carried"),
                ("features_recomputed", "Examples whose features the trainer computed with its own target"))

    def __init__(self, trainer: DrafterTrainer):
        self.trainer = trainer

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from specrl.telemetry import token_use

        t, flow = self.trainer, self.trainer.throughput
        values = {"consumer_lag": flow.lag_records - len(t.queue), "lag_records": flow.lag_records,
                  "lag_seconds": flow.lag_s, "produced_records_per_s": flow.produced_records_per_s,
                  "produced_tokens_per_s": flow.produced_tokens_per_s,
                  "consumed_records_per_s": flow.consumed_records_per_s,
                  "consumed_tokens_per_s": flow.consumed_tokens_per_s, "queued": len(t.queue),
                  "heldout": len(t.heldout), "steps": t.step, "records": t.records, "skipped": t.skipped,
                  "orphans": t.book.orphans, "expired_records": t.expired, "replay_steps": t.replays,
                  "replayed_records": t.replayed_records, "features_shipped": t.features.shipped,
                  "features_recomputed": t.features.recomputed}
        for name, doc in self.GAUGES:
            yield GaugeMetricFamily(f"specrl_trainer_{name}", doc, value=values[name])
        for name, doc in self.COUNTERS:
            yield CounterMetricFamily(f"specrl_trainer_{name}", doc, value=values[name])
        uses = CounterMetricFamily(token_use.FAMILY, token_use.DOC, labels=["use"])
        for use in token_use.TRAINER_USES:
            uses.add_metric([use], t.tokens[use])
        yield uses
