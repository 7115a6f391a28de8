"""One swap, whoever asks for it (the admin API, the follower): take the version from this server's store
(verified against its manifest), else pull it (Ray's object store, then the durable store:
`weights.object_store.pull`, which verifies the copy before it lands), have the serving loop load and check it
off the decode path and apply it at a step boundary, count it. The caller holds `swap_lock` (one swap at a
time). A failed swap changes nothing: the old weights keep serving."""

from __future__ import annotations

import asyncio
import logging

from specrl.engine.swap import SwapResult, check_swap
from specrl.errors import SpecrlError, SwapError
from specrl.weights.object_store import pull

log = logging.getLogger("specrl.serving")


async def swap_to(state, role: str, version: str, mode: str, origin: str) -> SwapResult:
    """state: the app's (`loop`, `store`, `durable`, `settings`, `metrics`). origin: who asked, for the log
    line ("admin", "follow")."""
    check_swap(role, mode)
    if role == "drafter" and not state.loop.has_drafter:
        raise SwapError(state.loop.no_drafter_reason)
    try:
        directory, _ = await asyncio.to_thread(pull, state.store, role, version, deployment=state.settings.deployment,
                                               durable=state.durable, pulls=state.metrics.pulls)
        result = await state.loop.swap(role, version, mode, directory)
    except SpecrlError:
        state.metrics.swaps.labels(role, "failed").inc()
        raise
    state.metrics.swaps.labels(role, "ok").inc()
    log.info("swap role=%s version=%s mode=%s origin=%s load_ms=%.1f swap_ms=%.1f", role, version, mode, origin,
             result.load_ms, result.swap_ms)
    return result


def serving_versions(loop) -> dict[str, str]:
    return {"policy": loop.target_version, "drafter": loop.drafter_version}
