"""The server's half of the effective-token yield on /metrics: `specrl_tokens_total{use=...}` read
from the engine's counters and its sink at scrape time (no HTTP: the registry's text, parsed as
`specrl up` and `bench adapt` parse it)."""

from prometheus_client import generate_latest

from specrl.apps.scrape import token_uses
from specrl.serving.engine_loop import EngineLoop
from specrl.serving.metrics import ServerMetrics
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry.record import SegmentRecord
from specrl.telemetry.sink import MemorySink
from specrl.telemetry.token_use import SERVER_USES, server_uses
from tests.engine.conftest import chat_prompts


def test_the_server_exports_every_token_it_computed_by_use(make_engine, tokenizer):
    engine = make_engine(fixed_draft_tokens=3, prefix_cache=False)
    prompt = chat_prompts(tokenizer, 1)[0]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.generate([prompt], params)
    engine.generate([prompt], params)  # the same prompt again, no prefix cache: computed twice
    uses = token_uses(generate_latest(ServerMetrics(EngineLoop(engine, telemetry=engine.sink)).registry).decode())
    assert set(uses) == set(SERVER_USES)
    assert uses == {use: float(n) for use, n in server_uses(engine.stats, engine.sink).items()}
    assert uses["served"] == 24 and uses["prompt_repeated"] > 0 and uses["draft_rejected"] > 0
    assert uses["prompt"] + uses["prompt_repeated"] == 2 * len(prompt)
    assert uses["kv_recomputed"] == 0 and uses["telemetry_dropped"] == 0


def test_records_the_sink_drops_count_as_dropped_tokens(make_engine):
    sink = MemorySink(capacity=1)
    for i in range(3):
        sink.emit(SegmentRecord(f"r{i}", 0, "base", "none", prompt_ids=[1, 2], tokens=[3]))
    text = generate_latest(ServerMetrics(EngineLoop(make_engine(drafter="none"), telemetry=sink)).registry).decode()
    assert token_uses(text)["telemetry_dropped"] == 2 * 3  # two evicted records, prompt and token each
