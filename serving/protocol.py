"""The OpenAI-compatible wire format: request models (validated by pydantic) and response shapes.

Unknown fields are refused (400, naming the field) rather than silently ignored, except a few
that carry no meaning for generation (`user`, `metadata`, `store`). vLLM's extra sampling
parameters are accepted with vLLM's meaning (`null` = the default); their ranges are checked by
`SamplingParams.check` (400 naming the parameter).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from specrl.errors import InvalidRequestError
from specrl.speculation.sampling import MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 8
IGNORED = ("user", "metadata", "store")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    # vLLM-style extension: also return prompt and completion token ids per choice (RL rollouts)
    return_token_ids: bool = False
    metadata: dict | None = None
    store: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    def check_supported(self) -> None:
        """Raise InvalidRequestError for what this server does not do (the ranges: SamplingParams.check)."""

    def sampling(self, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
        seed = None if self.seed is None else self.seed + index  # n samples must differ
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, seed=seed,
            stop=tuple(self.stop or ()), stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0),
            min_tokens=_or(self.min_tokens, 0), repetition_penalty=_or(self.repetition_penalty, 1.0),
            presence_penalty=_or(self.presence_penalty, 0.0), frequency_penalty=_or(self.frequency_penalty, 0.0),
            logit_bias=_logit_bias(self.logit_bias), include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens)


def _or(value, default):
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias {"<token id>": bias} -> ((id, bias), ...); a key that is no token id is a 400."""
    pairs = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        pairs[token] = float(value)
    return tuple(pairs.items())


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt's text before each choice's text
    best_of: int | None = None  # sample this many per prompt, return the n with the highest cumulative log-prob
    suffix: str | None = None

    @property
    def samples(self) -> int:
        """Choices generated per prompt (best_of, else n)."""
        return self.best_of or self.n

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo and self.logprobs is not None:
            raise InvalidRequestError("echo with logprobs is not supported: prompt log-probs are not computed",
                                      param="echo")
        if self.best_of is not None:
            if not 1 <= self.best_of <= MAX_N or self.best_of < self.n:
                raise InvalidRequestError(f"best_of must be in [n={self.n}, {MAX_N}], got {self.best_of}",
                                          param="best_of")
            if self.stream and self.best_of > self.n:
                raise InvalidRequestError("best_of > n cannot stream: the best choices are known at the end",
                                          param="best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are supported
            parts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise InvalidRequestError(f"content part type {part.get('type')!r} is not supported", param="messages")
                parts.append(str(part.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: object | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError("only response_format type 'text' is supported", param="response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs=true", param="top_logprobs")


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion `prompt` or chat `messages` (through the chat template)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompts only (the chat template adds its own)
    add_generation_prompt: bool = True  # messages only
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def fingerprint(target_version: str, drafter_version: str) -> str:
    """The versions that produced a response, in OpenAI's `system_fingerprint` field."""
    return f"specrl:target={target_version};drafter={drafter_version}"


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
