"""The drafter trainer on a real Redis stream filled by a real engine (tiny model)."""

import copy
import uuid

import httpx
import pytest
import redis
import torch

from specrl.config import Settings
from specrl.engine.engine import Engine
from specrl.spec.sampling import SamplingParams
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


def fill_stream(home, deployment, tokenizer, n=24, max_tokens=40):
    """Serve n greedy requests on the tiny model; their records land on the deployment's stream."""
    sink = RedisSink(REDIS_URL, events_stream(deployment))
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
                             store=str(tmp_path / "store"), train_records=4, heldout_fraction=0.25, lr=3e-3,
                             publish_every_steps=10 ** 6, publish_every_s=10 ** 6, **overrides)
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
    first = make_trainer(home, tmp_path, deployment, tiny_dir, checkpoint_every_steps=2)
    for _ in range(3):  # checkpoints + acks at step 2, then trains on more and "dies" before acking them
        first.run_once(block_ms=10)
    assert first.unacked and first.step == 3
    saved = torch.load(tmp_path / "t0.pt", weights_only=False)
    second = make_trainer(home, tmp_path, deployment, tiny_dir)  # same consumer and state file: resumes
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
    rows, ids = trainer._in_draft_vocab([(0, inside), (1, outside)], width=2)
    assert rows.tolist() == [0] and ids.tolist() == [inside]


def test_negative_unroll_steps_is_refused(home, tmp_path, deployment, tiny_dir):
    from specrl.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unroll_steps must be >= 0, got -1"):  # the settings refuse it
        make_trainer(home, tmp_path, deployment, tiny_dir, unroll_steps=-1)
