"""The effective-token yield: every token the machine computed, counted by what it was used for.

Both processes export one Prometheus counter family, `specrl_tokens_total{use="..."}` (the
server its uses, the trainer its own); `token_yield` combines the two scrapes.

Server (target positions the native engine computed, and what became of its records):
- served: tokens generated and streamed to a client;
- prompt: prompt positions prefilled whose prefix no earlier prompt had (needed to answer);
- prompt_repeated: prompt positions prefilled although an earlier prompt had the same prefix
  (the prefix cache off, or its KV gone): computed twice;
- kv_recomputed: positions recomputed when an interrupting policy swap moved a running request
  to new weights: computed twice;
- draft_rejected: draft positions the target verified and rejected;
- telemetry_dropped: prompt and committed tokens of records the sink dropped (never trained).
Trainer (what became of the tokens in the records it read):
- trained: drafter positions trained on, the first time;
- replayed: positions trained again from the replay buffer (the trainer was ahead);
- heldout: positions kept for the held-out evaluation;
- truncated: positions of a trained example beyond the optimizer step's position budget;
- expired: positions of records older than the age bound when their turn came (the trainer was behind);
- unusable: positions of records it could not use (no features and no target to recompute
  them, a policy version it cannot load);
- trainer_recomputed: positions whose target features the trainer computed itself (its own
  forward of the target): computed twice.

computed = prompt + prompt_repeated + kv_recomputed + served + draft_rejected + trainer_recomputed
useful   = prompt + served  (the computation that answered a request)
yield    = useful / computed
trained_share = trained / useful  (how much of what answered requests also taught the drafter)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specrl.telemetry.sink import SinkCounters

FAMILY = "specrl_tokens"  # exported as specrl_tokens_total{use=...}
SERVER_USES = ("served", "prompt", "prompt_repeated", "kv_recomputed", "draft_rejected", "telemetry_dropped")
TRAINER_USES = ("trained", "replayed", "heldout", "truncated", "expired", "unusable", "trainer_recomputed")
COMPUTED = ("prompt", "prompt_repeated", "kv_recomputed", "served", "draft_rejected", "trainer_recomputed")
USEFUL = ("prompt", "served")
DOC = "Tokens the machine computed, by use (specrl/telemetry/token_use.py)"


def server_uses(stats, telemetry: "SinkCounters | None") -> dict[str, int]:
    """The server's counts from the engine's `EngineStats` and its sink (None: no telemetry)."""
    spec = stats.spec
    return {"served": stats.generated_tokens,
            "prompt": stats.prompt_tokens_computed - stats.prompt_tokens_repeated,
            "prompt_repeated": stats.prompt_tokens_repeated,
            "kv_recomputed": stats.kv_recomputed_tokens,
            "draft_rejected": spec.num_draft_tokens - spec.num_accepted_tokens,
            "telemetry_dropped": telemetry.dropped_tokens if telemetry is not None else 0}


def token_yield(uses: dict[str, float]) -> dict:
    """uses: counts by use (server and trainer together; missing = 0) -> computed, useful, yield,
    trained_share (None when nothing was computed)."""
    computed = sum(uses.get(u, 0) for u in COMPUTED)
    useful = sum(uses.get(u, 0) for u in USEFUL)
    return {"computed": computed, "useful": useful, "yield": useful / computed if computed else None,
            "trained_share": uses.get("trained", 0) / useful if useful else None}
