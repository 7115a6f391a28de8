import pytest

from specrl.config import Settings
from specrl.serving.engine import Engine
from specrl.telemetry.sink import MemorySink


@pytest.fixture
def make_engine(home):
    """make_engine(model="tiny-random", drafter="day0", **settings) -> Engine with a MemorySink."""

    def make(model="tiny-random", drafter="day0", **overrides):
        settings = Settings.load(home=home, model=model, drafter=drafter, **overrides)
        return Engine.from_settings(settings, sink=MemorySink(), progress=False)

    return make


def chat_prompts(tokenizer, n):
    topics = ["the moon", "binary search", "a cat", "Paris", "prime numbers", "rain", "the ocean", "chess",
              "a bicycle", "volcanoes", "music", "bread", "the stock market", "sleep", "a robot", "winter"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"Tell me about {topics[i % len(topics)]}."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]
