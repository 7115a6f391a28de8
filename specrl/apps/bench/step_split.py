"""What a plain decode step costs beyond its forward: the engine's planning, sampling, commit and Python.

`step_split(engine, prompt, dtype_label)`: the engine (no drafter, no index) decodes `tokens` tokens greedily from
one prompt, its steps after the first token timed, alternating round by round with as many bare forwards (and
logits) of the same model at the same positions; both in this process, so that a slow spell of the machine falls
on both. -> {dtype, step_ms, forward_ms, outside_ms, tokens, repeats} (medians over the rounds).
"""

from __future__ import annotations

import statistics
import time

import torch

from specrl.speculation.sampling import SamplingParams


def step_split(engine, prompt: list[int], dtype_label: str, tokens: int = 48, repeats: int = 5) -> dict:
    """engine: a plain Engine (its drafter and index off); prompt: token ids."""
    model = engine.target
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    cache = model.new_cache(1, len(prompt) + tokens + 1)
    step_ms, forward_ms = [], []
    with torch.inference_mode():
        for rep in range(repeats + 1):
            engine.submit(prompt, params)
            while not any(out.new_token_ids for out in engine.step()):  # the prompt's prefill, its first token
                pass
            steps, started = 0, time.perf_counter()
            while engine.has_work():
                engine.step()
                steps += 1
            stepped = (time.perf_counter() - started) * 1000 / steps
            started = time.perf_counter()
            for i in range(steps):
                model.logits(model(torch.zeros(1, 1, dtype=torch.long), torch.arange(1),
                                   torch.full((1,), len(prompt) + i), cache))
            if rep:  # the first round warms both up
                step_ms.append(stepped)
                forward_ms.append((time.perf_counter() - started) * 1000 / steps)
    step, forward = statistics.median(step_ms), statistics.median(forward_ms)
    return {"dtype": dtype_label, "step_ms": step, "forward_ms": forward, "outside_ms": step - forward,
            "tokens": tokens, "repeats": repeats}
