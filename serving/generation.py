"""One choice of an API response: an engine request turned into text deltas, logprobs and stats.

Text is decoded from the choice's tokens as its SamplingParams say (`skip_special_tokens`,
`spaces_between_special_tokens`; the stop string cut before it, or after it with
`include_stop_str_in_output`), the same for both backends. `echo` (completions) is the prompt's
text, put before the first delta and the final text.
"""

from __future__ import annotations

import asyncio
import time

from specrl.engine.outputs import StepOutput
from specrl.serving.loop import ServingLoop
from specrl.speculation.quantities import SpecCounts
from specrl.speculation.sampling import SamplingParams


class ChoiceStream:
    def __init__(self, tokenizer, index: int, prompt_ids: list[int], params: SamplingParams, *, chat: bool,
                 return_token_ids: bool = False, echo: str = "", show_logprobs: bool = True):
        """show_logprobs False: the log-probs were asked for internally (best_of ranks by them) and
        stay out of the response."""
        self.tokenizer, self.index, self.prompt_ids, self.params, self.chat = tokenizer, index, prompt_ids, params, chat
        self.return_token_ids, self.echo, self.show_logprobs = return_token_ids, echo, show_logprobs
        self._echoed = False
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.logprobs: list[dict] = []
        self.seq = None
        self.target_version = self.drafter_version = ""

    def submit(self, loop: ServingLoop, request_id: str) -> None:
        self.request_id = request_id
        self.target_version, self.drafter_version = loop.target_version, loop.drafter_version
        self.seq = loop.submit(self.prompt_ids, self.params, request_id)

    def add(self, out: StepOutput) -> tuple[str, dict | None, str | None]:
        """-> (text delta, logprobs payload for these tokens or None, finish reason or None)."""
        self.token_ids += out.new_token_ids
        self.target_version, self.drafter_version = out.target_version, out.drafter_version
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.params.skip_special_tokens,
                                     spaces_between_special_tokens=self.params.spaces_between_special_tokens)
        stops = [(full.find(s), s) for s in self.params.stop if s in full]
        if stops:
            at, stop = min(stops)
            full = full[: at + len(stop)] if self.params.include_stop_str_in_output else full[:at]
        elif not out.finished:
            full = full.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for the rest
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text = full if full.startswith(self.text) else self.text
        if not self._echoed:
            delta, self._echoed = self.echo + delta, True
        entries = self._logprob_entries(out) if out.logprobs is not None else None
        if entries is not None:
            self.logprobs += entries
        if out.finished:
            self.finish_reason = out.finish_reason
        return delta, self._logprobs_payload(entries), self.finish_reason if out.finished else None

    def _logprob_entries(self, out: StepOutput) -> list[dict]:
        decode = self.tokenizer.decode
        return [{"token": decode([tok]), "logprob": lp, "bytes": list(decode([tok]).encode()),
                 "top_logprobs": [{"token": decode([i]), "logprob": v, "bytes": list(decode([i]).encode())}
                                  for i, v in top]}
                for tok, (lp, top) in zip(out.new_token_ids, out.logprobs)]

    def _logprobs_payload(self, entries: list[dict] | None) -> dict | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": entries}
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": []}

    @property
    def cumulative_logprob(self) -> float:
        """The sum of the chosen tokens' log-probs (needs params.logprobs set)."""
        return sum(e["logprob"] for e in self.logprobs)

    def final_choice(self) -> dict:
        shown = self.params.logprobs is not None and self.show_logprobs
        logprobs = self._logprobs_payload(self.logprobs) if shown else None
        choice = {"index": self.index, "logprobs": logprobs, "finish_reason": self.finish_reason}
        text = self.echo + self.text
        choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
        if self.return_token_ids:
            choice.update(prompt_token_ids=self.prompt_ids, token_ids=self.token_ids)
        return choice

    # spec-decode counters and version runs of this choice, from the engine's request
    @property
    def spec(self) -> SpecCounts:
        return self.seq.spec

    @property
    def version_runs(self) -> list[list]:
        return self.seq.version_runs


async def run_choices(loop: ServingLoop, streams: list[ChoiceStream], metrics, arrival: float,
                      events: asyncio.Queue | None = None) -> None:
    """Consume every choice's outputs concurrently; observe TTFT/ITL; push (choice, delta,
    logprobs, finish) events when streaming. A failure pushes (None, error, None, None)."""

    async def consume(choice: ChoiceStream) -> None:
        last = None
        async for out in loop.outputs(choice.request_id):
            t = time.perf_counter()
            if out.new_token_ids:
                if last is None:
                    metrics.ttft.observe(t - arrival)
                else:
                    for _ in out.new_token_ids:
                        metrics.itl.observe((t - last) / len(out.new_token_ids))
                last = t
            delta, logprobs, finish = choice.add(out)
            if events is not None and (delta or logprobs or finish):
                events.put_nowait((choice, delta, logprobs, finish))

    try:
        await asyncio.gather(*(consume(s) for s in streams))
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if events is not None:
            events.put_nowait((None, exc, None, None))
        raise
