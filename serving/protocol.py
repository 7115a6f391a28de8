"""The OpenAI-compatible wire format: request models (validated by pydantic) and response shapes.

Unknown fields are refused (400, naming the field) rather than silently ignored, except a few
that carry no meaning for generation (`user`, `metadata`, `store`). vLLM's extra sampling
parameters are accepted with vLLM's meaning (`null` = the default); their ranges are checked by
`SamplingParams.check` (400 naming the parameter).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator

from specrl.errors import InvalidRequestError
from specrl.speculation.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_TOP_LOGPROBS, SamplingParams

MAX_N = 8
MAX_STOP = 4  # stop strings a request may give (OpenAI's bound)
IGNORED = ("user", "metadata", "store")

# What the OpenAPI document states is what validation enforces (issue 60): the ranges of the sampling parameters
# are pydantic constraints, so the document carries them. Where a rule is checked after parsing, with a message
# that names the offending key (logit_bias: `_logit_bias` and SamplingParams.check; text-only content parts:
# ChatMessage.text), the document states the same rule through WithJsonSchema.
NonEmptyStr = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]
LogitBias = Annotated[dict[str, float], WithJsonSchema({
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS, "maximum": MAX_LOGIT_BIAS}})]
TextParts = Annotated[list[dict], WithJsonSchema({
    "type": "array", "items": {"type": "object", "required": ["type"],
                               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}})]


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
    stop: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)], None] = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extra sampling parameters
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(None, ge=0)  # and at most max_tokens
    repetition_penalty: float | None = Field(None, gt=0.0)
    stop_token_ids: list[TokenId] | None = None
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
        """One string or a list of them -> a list (the type's constraints checked each)."""
        return [v] if isinstance(v, str) else (v or [])

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
    prompt: Union[NonEmptyStr, Annotated[list[NonEmptyStr], Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]
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
    content: Union[str, TextParts, None] = None  # a missing content reads as empty text

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
    # OpenAI's rule, stated where a client generator reads it: top_logprobs needs logprobs=true (check_supported)
    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})
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
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # the chat template refuses an empty conversation
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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape: every 4xx this server sends (and a 503 while the engine is down) has this body."""

    error: ErrorDetail


ERRORS = {"4XX": {"model": ErrorResponse, "description": "the request was refused; `error.param` names the field"}}
# The same for a route whose own answer is not JSON (/metrics, /ping): FastAPI would state its errors in that type.
ERRORS_AS_JSON = {"4XX": {"description": ERRORS["4XX"]["description"],
                          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}}
# The generation routes: JSON, or server-sent events with `stream: true`; 503 while the engine is down.
GENERATION = {200: {"description": "the completion (JSON), or its chunks as server-sent events with `stream: true`",
                    "content": {"text/event-stream": {}}},
              503: {"model": ErrorResponse, "description": "the engine is not running (stopping, or failed)"}}


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
