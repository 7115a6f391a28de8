"""`specrl train-drafter`: the trainer process (signals, logging, assembly)."""

from __future__ import annotations

import logging
import signal
import sys
import time

from specrl.assets import resolve_model
from specrl.config import Settings
from specrl.errors import InvalidRequestError
from specrl.telemetry import RecordReader, events_stream
from specrl.telemetry.event_log import EventLog
from specrl.trainer.drafter_trainer import DrafterTrainer
from specrl.trainer.publisher import Publisher
from specrl.weights import WeightsStore

GROUP = "drafter"


def build_trainer(settings: Settings) -> DrafterTrainer:
    if not settings.redis_url:
        raise InvalidRequestError("the trainer needs --redis-url (or SPECRL_REDIS_URL)")
    store = WeightsStore(settings.store_path)
    servers = [s for s in settings.servers.split(",") if s]
    reader = RecordReader(settings.redis_url, events_stream(settings.deployment), GROUP, settings.consumer)
    publisher = Publisher(store, servers, settings.admin_token) if servers else None
    state = settings.home / "trainer" / settings.deployment / f"{settings.consumer}.pt"
    return DrafterTrainer(settings, resolve_model(settings.model, settings.home), reader, store=store,
                          publisher=publisher, state_path=state, events=EventLog(settings.trainer_events_path))


def train_drafter(settings: Settings) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    trainer = build_trainer(settings)
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    logging.getLogger("specrl.trainer").info(
        "event=start deployment=%s consumer=%s objective=%s serving_drafter=%s", settings.deployment,
        settings.consumer, settings.objective, trainer.serving_version)
    trainer.events.write("start", deployment=settings.deployment, consumer=settings.consumer,
                         objective=settings.objective, serving_drafter=trainer.serving_version)
    trainer.run(lambda: bool(stopping), on_step=_metrics(settings.trainer_metrics_port))
    trainer.save_state()
    if trainer.unacked:
        trainer.reader.ack(trainer.unacked)
    return 0


def _metrics(port: int):
    """Export the trainer's progress and consumer lag on /metrics when a port is given."""
    if port <= 0:
        return None
    from prometheus_client import Gauge, start_http_server

    start_http_server(port, addr="127.0.0.1")
    gauges = {name: Gauge(f"specrl_trainer_{name}", doc) for name, doc in (
        ("consumer_lag", "Stream entries not yet delivered to the group"), ("steps", "Optimizer steps"),
        ("records", "Records trained on"), ("skipped", "Records skipped (unloadable policy version)"),
        ("orphans", "Segments whose earlier segments never arrived"), ("heldout", "Held-out examples kept"))}
    last = [0.0]

    def update(trainer: DrafterTrainer) -> None:
        if time.monotonic() - last[0] < 2.0:
            return
        last[0] = time.monotonic()
        gauges["consumer_lag"].set(trainer.reader.lag())
        for name, value in (("steps", trainer.step), ("records", trainer.records), ("skipped", trainer.skipped),
                            ("orphans", trainer.book.orphans), ("heldout", len(trainer.heldout))):
            gauges[name].set(value)

    return update
