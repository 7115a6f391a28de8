"""The drafter trainer on a real Redis stream filled by a real engine (tiny model)."""

import copy
import uuid

import httpx
import pytest
import redis
import torch

from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.speculation.sampling import SamplingParams
from specrl.telemetry import RecordReader, RedisSink, SegmentRecord, StepRecord, events_stream
from specrl.trainer.drafter_trainer import DrafterTrainer
from specrl.trainer.main import GROUP
from specrl.trainer.publisher import Publisher
from specrl.weights import WeightsStore
from tests.engine.conftest import chat_prompts
from tests.serving.conftest import ADMIN_TOKEN, REDIS_URL, start_server

pytestmark = pytest.mark.redis


@pytest.fixture
def deployment():
    name = f"test-trainer-{uuid.uuid4().hex[:10]}"
    yield name
    r = redis.Redis.from_url(REDIS_URL)
    r.delete(events_stream(name), events_stream(name) + ":dead")


def fill_stream(home, deployment, tokenizer, n=24, max_tokens=40, features=False):
    """Serve n greedy requests on the tiny model; their records land on the deployment's stream
    (with the target's features when `features`)."""
    sink = RedisSink(REDIS_URL, events_stream(deployment), features_max_bytes=(1 << 22) if features else 0)
    settings = Settings.load(home=home, model="tiny-random", max_batch=8)
    engine = Engine.from_settings(settings, sink=sink, progress=False)
    prompts = chat_prompts(tokenizer, n)
    for i, p in enumerate(prompts):  # distinct prompts: vary the text a little
        prompts[i] = p[:-3] + tokenizer.encode(f" #{i}") + p[-3:]
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    sink.close(10)
    assert sink.sent == sink.emitted
    return sink.sent


def make_trainer(home, tmp_path, deployment, tiny_dir, consumer="t0", publisher=None, **overrides):
    settings = Settings.load(home=home, model="tiny-random", deployment=deployment, consumer=consumer,
                             store=str(tmp_path / "store"), **{"train_records": 4, "heldout_fraction": 0.25, "lr": 3e-3,
                                                               "publish_every_steps": 10 ** 6, "publish_every_s": 10 ** 6,
                                                               **overrides})
    reader = RecordReader(REDIS_URL, events_stream(deployment), GROUP, consumer)
    reader.ensure_group()
    return DrafterTrainer(settings, tiny_dir, reader, store=WeightsStore(settings.store_path), publisher=publisher,
                          state_path=tmp_path / f"{consumer}.pt")


def drain(trainer, limit=200):
    for _ in range(limit):
        if trainer.run_once(block_ms=10) == 0:
            return


def test_trainer_learns_and_beats_the_day0_drafter(home, tmp_path, deployment, tiny_dir, tokenizer):
    fill_stream(home, deployment, tokenizer)
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir)
    day0 = copy.deepcopy(trainer.drafter)
    drain(trainer)
    assert trainer.step > 0 and len(trainer.heldout) > 0
    before, after = trainer.evaluate(day0), trainer.evaluate(trainer.drafter)
    assert after > before, (before, after)
    pending = redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"]
    assert pending == 0  # everything acked once trained


def test_killed_trainer_loses_nothing_and_trains_nothing_twice(home, tmp_path, deployment, tiny_dir, tokenizer):
    import zlib

    import torch

    fill_stream(home, deployment, tokenizer, n=12)
    records = [SegmentRecord.from_msgpack(f[b"r"]) for _, f in redis.Redis.from_url(REDIS_URL).xrange(events_stream(deployment))]
    heldout = sum(zlib.crc32(r.request_id.encode()) % 1000 < 250 for r in records)
    # It reads all 12 at once (its queue holds 4 steps of 3): trains 3 + 3, checkpoints (with the 2+
    # examples still queued) and acks at step 2, then trains on more and "dies" before the next checkpoint.
    first = make_trainer(home, tmp_path, deployment, tiny_dir, checkpoint_every_steps=2, train_records=3,
                         trainer_replay_records=0)
    for _ in range(3):
        first.run_once(block_ms=10)
    saved = torch.load(tmp_path / "t0.pt", weights_only=False)
    assert first.step == 3 and first.records > saved["records"] and saved["queue"]
    second = make_trainer(home, tmp_path, deployment, tiny_dir, train_records=3)  # same consumer and state: resumes
    assert (second.step, second.records) == (saved["step"], saved["records"]) == (2, saved["records"])
    drain(second)
    assert second.records == len(records) - heldout  # every training record exactly once
    assert redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"] == 0


def test_poisoned_records_go_to_the_dead_letter_stream(home, tmp_path, deployment, tiny_dir, tokenizer):
    fill_stream(home, deployment, tokenizer, n=4)
    r = redis.Redis.from_url(REDIS_URL)
    r.xadd(events_stream(deployment), {"r": b"\x00garbage"})
    bad = SegmentRecord("no-prompt", 0, "base", "day0", prompt_ids=None, tokens=[1, 2])
    r.xadd(events_stream(deployment), {"r": bad.to_msgpack()})
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir)
    drain(trainer)
    dead = r.xrange(events_stream(deployment) + ":dead")
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert len(dead) == 2 and any("prompt" in x for x in reasons)
    assert trainer.step > 0


def test_a_worse_candidate_is_not_published(home, tmp_path, deployment, tiny_dir, tokenizer):
    fill_stream(home, deployment, tokenizer, n=12)
    store_dir = tmp_path / "store"
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir,
                           publisher=Publisher(WeightsStore(store_dir), ["http://127.0.0.1:9"], ADMIN_TOKEN))
    drain(trainer)
    import torch

    with torch.no_grad():  # ruin the candidate
        for p in trainer.drafter.parameters():
            p.mul_(-3.0)
    trainer._last_eval_step, trainer.settings = -1, trainer.settings.replace(publish_every_steps=0)
    assert trainer.maybe_publish() is None
    assert WeightsStore(store_dir).versions("drafter") == []
    assert trainer.history[-1]["candidate_tau"] < trainer.history[-1]["serving_tau"]


def test_a_candidate_as_good_publishes_only_when_it_learned_from_new_records(home, tmp_path, deployment, tiny_dir,
                                                                             tokenizer, monkeypatch):
    fill_stream(home, deployment, tokenizer, n=12)
    server = start_server(home, tmp_path)
    try:
        store = WeightsStore(server.store)
        trainer = make_trainer(home, tmp_path, deployment, tiny_dir, publisher=Publisher(store, [server.url], ADMIN_TOKEN))
        drain(trainer)
        assert trainer.records > 0 and trainer.heldout
        evaluated = []
        monkeypatch.setattr(trainer, "evaluate", lambda drafter: evaluated.append(drafter) or 1.5)  # a tie
        trainer.settings = trainer.settings.replace(publish_every_steps=0)
        trainer._last_eval_step = -1
        version = trainer.maybe_publish()
        assert version is not None and trainer.serving_version == version  # as good, and learned: published
        assert httpx.get(server.url + "/health").json()["drafter_version"] == version
        assert len(evaluated) == 2  # candidate and serving drafter
        trainer._last_eval_step = -1  # due again, but no record trained since: nothing new to serve
        assert trainer.maybe_publish() is None
        assert len(evaluated) == 3  # the serving drafter's tau on this held-out slice was kept
        trainer._last_eval_step, trainer._eval_s = -1, 1e6  # the last evaluation took "long": training first
        assert trainer.maybe_publish() is None and len(evaluated) == 3
        assert sorted(m.version for m in store.versions("drafter")) == sorted(["day0", version])
    finally:
        server.stop()


def test_canary_rolls_back_a_drafter_that_underperforms_live(home, tmp_path, deployment, tiny_dir, tokenizer):
    server = start_server(home, tmp_path, "--redis-url", REDIS_URL)
    try:
        store = WeightsStore(server.store)
        trainer = make_trainer(home, tmp_path, server.deployment, tiny_dir,
                               publisher=Publisher(store, [server.url], ADMIN_TOKEN), canary_tokens=20)
        v1 = trainer.publisher.publish(trainer.drafter, parent=None, target_version="base", metrics={})
        v2 = trainer.publisher.publish(trainer.drafter, parent=v1, target_version="base", metrics={})
        assert trainer.publisher.swap(v2).swapped == [server.url]
        trainer.serving_version = v2
        trainer.canary.watch(v2, v1)

        def record(version, accepted):
            return SegmentRecord("r", 0, "base", version, prompt_ids=[1],
                                 steps=[StepRecord(i, 4, [1, 2, 3, 4], [0.0] * 4, accepted, 5) for i in range(10)])

        trainer.canary.observe(record(v1, 3))  # the previous drafter accepted 3 of 4 live
        trainer.canary.observe(record(v2, 0))  # the new one accepts nothing
        trainer.check_canary()
        assert httpx.get(server.url + "/health").json()["drafter_version"] == v1
        assert trainer.serving_version == v1 and "accepts 0.000" in trainer.history[-1]["reason"]
    finally:
        server.stop()
        redis.Redis.from_url(REDIS_URL).delete(server.stream)


def test_a_dead_consumers_records_are_claimed(home, tmp_path, deployment, tiny_dir, tokenizer):
    import time

    fill_stream(home, deployment, tokenizer, n=8)
    dead = make_trainer(home, tmp_path, deployment, tiny_dir, consumer="dead", checkpoint_every_steps=10 ** 6)
    dead.run_once(block_ms=10)  # holds records, never acks: then "dies"
    assert dead.unacked
    survivor = make_trainer(home, tmp_path, deployment, tiny_dir, consumer="alive", claim_idle_ms=100)
    drain(survivor)  # new records first
    time.sleep(0.2)
    drain(survivor)  # then the dead consumer's idle ones
    assert redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"] == 0
    assert survivor.records + len(survivor.heldout) >= 8 - survivor.book.orphans


def test_trainer_survives_a_redis_restart(home, tmp_path, tiny_dir, tokenizer):
    import shutil
    import subprocess
    import threading
    import time

    from specrl.apps.launch import free_port

    port = free_port()
    start = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    assert shutil.which("redis-server")
    server = subprocess.Popen(start, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url).ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        settings = Settings.load(home=home, model="tiny-random", deployment="restart", consumer="t0",
                                 store=str(tmp_path / "store"), train_records=4, heldout_fraction=0.0,
                                 publish_every_steps=10 ** 6, publish_every_s=10 ** 6)
        trainer = DrafterTrainer(settings, tiny_dir, RecordReader(url, events_stream("restart"), GROUP, "t0"),
                                 store=WeightsStore(settings.store_path), publisher=None, state_path=tmp_path / "t.pt")
        stop = threading.Event()
        worker = threading.Thread(target=trainer.run, args=(stop.is_set,), kwargs={"block_ms": 50})
        worker.start()
        record = SegmentRecord("a", 0, "base", "day0", prompt_ids=[1, 2, 3, 4, 5], tokens=[6, 7, 8, 9], finish_reason="stop")
        redis.Redis.from_url(url).xadd(events_stream("restart"), {"r": record.to_msgpack()})
        while trainer.records < 1:
            time.sleep(0.05)
        server.kill()  # Redis dies and comes back empty
        server.wait()
        time.sleep(0.5)
        server = subprocess.Popen(start, stdout=subprocess.DEVNULL)
        for _ in range(100):
            try:
                redis.Redis.from_url(url).xadd(events_stream("restart"),
                                               {"r": SegmentRecord("b", 0, "base", "day0", prompt_ids=[1, 2, 3], tokens=[4, 5, 6],
                                                                   finish_reason="stop").to_msgpack()})
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        deadline = time.monotonic() + 30
        while trainer.records < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        worker.join(timeout=30)
        assert trainer.records == 2 and not worker.is_alive()
    finally:
        server.kill()


@pytest.mark.parametrize("objective", ["kl_neg", "pg"])
def test_reduced_draft_vocabulary_trains_on_the_tokens_it_can_draft(home, tmp_path, deployment, tiny_dir, objective):
    """Rejected and drafted tokens outside a reduced vocabulary have no draft id: they are left
    out of the objective's token terms, not looked up out of range."""
    from specrl.trainer.contexts import Example

    trainer = make_trainer(home, tmp_path, deployment, tiny_dir, draft_vocab_size=100, objective=objective)
    tokens = list(range(90, 110)) * 2
    inside, outside = 50, 500  # a draft id, and a token with none
    example = Example("r", 0, "base", "day0", tokens, first=0, start=10,
                      rejected=[(3, inside), (4, outside)], steps=[(5, [inside], 1), (6, [outside], 0), (7, [inside], 0)])
    before = trainer.drafter.head.detach().clone()
    loss = trainer.train([example])
    assert loss == loss and loss != float("inf")  # finite
    assert not torch.equal(trainer.drafter.head, before)  # the reduced head is what learns
    from specrl.trainer.objectives import in_draft_vocab

    rows, ids = in_draft_vocab(trainer.drafter, [(0, inside), (1, outside)], width=2)
    assert rows.tolist() == [0] and ids.tolist() == [inside]


def test_negative_unroll_steps_is_refused(home, tmp_path, deployment, tiny_dir):
    from specrl.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unroll_steps must be >= 0, got -1"):  # the settings refuse it
        make_trainer(home, tmp_path, deployment, tiny_dir, unroll_steps=-1)


def heldout_acceptance(trainer, drafter) -> float:
    """Mean accepted drafts (k = eval_k) over every held-out position: finer than `evaluate`'s
    tokens per step along one walk, which a few held-out examples leave at a handful of values."""
    from specrl.speculation.simulate import simulate_greedy

    drafter.eval()
    accepted = [simulate_greedy(drafter, features, torch.tensor(example.tokens), example.start,
                                trainer.settings.eval_k).accepted.float() for example, features in trainer.heldout]
    return float(torch.cat(accepted).mean())


def test_a_trainer_on_shipped_features_loads_no_target_layers(home, tmp_path, deployment, tiny_dir, tokenizer):
    fill_stream(home, deployment, tokenizer, features=True)
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir, trainer_recompute=False)
    day0 = copy.deepcopy(trainer.drafter)
    drain(trainer)
    assert trainer.step > 0 and trainer.features.shipped > 0 and len(trainer.heldout) > 0
    assert trainer.targets.loaded_full == [] and trainer.tokens["trainer_recomputed"] == 0
    assert trainer.tokens["trained"] > 0
    before, after = heldout_acceptance(trainer, day0), heldout_acceptance(trainer, trainer.drafter)
    assert after > before, (before, after)
    assert redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"] == 0


def test_a_trainer_without_a_target_stops_on_a_stream_without_features(home, tmp_path, deployment, tokenizer):
    """`specrl train-drafter --no-trainer-recompute` against records without features: one line
    naming the setting, exit 1."""
    import os
    import subprocess
    import sys

    fill_stream(home, deployment, tokenizer, n=2)
    for cache in ("models", "calibration"):  # the session's: a home of its own, without building tiny-random again
        (tmp_path / cache).symlink_to(home / cache, target_is_directory=True)
    proc = subprocess.run([sys.executable, "-m", "specrl.apps.cli", "train-drafter", "--model", "tiny-random",
                           "--redis-url", REDIS_URL, "--deployment", deployment, "--store", str(tmp_path / "store"),
                           "--consumer", "c-exit", "--no-trainer-recompute", "--threads", "1"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "SPECRL_HOME": str(tmp_path)})
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("specrl: error: ") and "carry no target features" in last and "--trainer-recompute" in last


def test_features_that_do_not_fit_are_dead_lettered_with_the_reason(home, tmp_path, deployment, tiny_dir):
    import dataclasses

    def record(request_id, tokens, rows):
        out = SegmentRecord(request_id, 0, "base", "day0", prompt_ids=[1, 2, 3, 4], tokens=tokens, finish_reason="stop")
        out.set_features(0, rows)
        return out

    good = record("good", [5, 6], torch.randn(5, 64))  # 5 x 64 float16: 640 bytes, the budget below
    short = dataclasses.replace(good, request_id="short", features=good.features[:-128])  # one row missing
    wide = record("wide", [5, 6], torch.randn(5, 32))  # the tiny target's hidden size is 64
    over = record("over", [5, 6, 7], torch.randn(6, 64))  # 768 bytes
    r = redis.Redis.from_url(REDIS_URL)
    for x in (good, short, wide, over):
        r.xadd(events_stream(deployment), {"r": x.to_msgpack()})
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir, record_features_max_bytes=640, heldout_fraction=0.0)
    drain(trainer)
    reasons = {f[b"reason"].decode() for _, f in r.xrange(events_stream(deployment) + ":dead")}
    assert len(reasons) == 3, reasons
    assert any("do not fit a context of 6 tokens" in x for x in reasons)
    assert any("feature_dim 32 is not the target's hidden size 64" in x for x in reasons)
    assert any("exceed the budget of 640" in x for x in reasons)
    assert trainer.records == 1 and trainer.features.shipped == 1
    assert r.xpending(events_stream(deployment), GROUP)["pending"] == 0  # dead-lettered ones are acked too


def test_old_records_expire_and_an_idle_trainer_replays(home, tmp_path, deployment, tiny_dir, tokenizer):
    import time

    fill_stream(home, deployment, tokenizer, n=6, features=True)
    time.sleep(0.3)
    stale = make_trainer(home, tmp_path / "stale", deployment, tiny_dir, trainer_max_age_s=0.2, heldout_fraction=0.0,
                         consumer="stale")
    drain(stale)
    assert stale.records == 0 and stale.expired == 6 and stale.tokens["expired"] > 0 and stale.step == 0
    assert redis.Redis.from_url(REDIS_URL).xpending(events_stream(deployment), GROUP)["pending"] == 0
    redis.Redis.from_url(REDIS_URL).xgroup_destroy(events_stream(deployment), GROUP)
    fresh = make_trainer(home, tmp_path / "fresh", deployment, tiny_dir, heldout_fraction=0.0, consumer="fresh",
                         trainer_replay_records=8)
    drain(fresh)  # its last call found nothing new and replayed (returning 0: no fresh work)
    assert fresh.records == 6 and fresh.replays == 1 and fresh.replayed_records == 4
    steps, replayed = fresh.step, fresh.tokens["replayed"]
    assert fresh.run_once(block_ms=10) == 0  # still nothing new: it replays instead of idling
    assert fresh.replays == 2 and fresh.step == steps + 1 and fresh.records == 6
    assert fresh.tokens["replayed"] > replayed > 0


def test_trainer_metrics_show_production_consumption_lag_and_token_uses(home, tmp_path, deployment, tiny_dir, tokenizer):
    from specrl.apps.launch import free_port
    from specrl.apps.scrape import sample_trainer
    from specrl.trainer.main import _metrics

    fill_stream(home, deployment, tokenizer, n=6, features=True)
    trainer = make_trainer(home, tmp_path, deployment, tiny_dir)
    port = free_port()
    hook = _metrics(port)
    hook(trainer)
    drain(trainer)
    trainer.throughput.update(trainer.records, trainer.tokens["trained"], 1.0, trainer.queue, force=True)
    sample = sample_trainer(f"http://127.0.0.1:{port}")
    assert sample["trained_records"] == trainer.records > 0 and sample["lag_records"] == 0
    assert sample["produced_records_per_s"] >= 0 and sample["consumed_records_per_s"] >= 0
    assert sample["uses"]["trained"] == trainer.tokens["trained"] > 0
    assert sample["uses"]["trainer_recomputed"] == trainer.tokens["trainer_recomputed"]
    assert set(sample["uses"]) >= {"trained", "replayed", "heldout", "expired", "unusable", "trainer_recomputed"}
