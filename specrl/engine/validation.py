"""A request's checks before any work is done (both serving backends)."""

from __future__ import annotations

from specrl.errors import InvalidRequestError
from specrl.speculation.sampling import SamplingParams


def check_request(prompt_ids: list[int], params: SamplingParams, vocab: int, limit: int) -> None:
    """Raise InvalidRequestError naming the first problem of a request."""
    params.check()
    params.check_vocab(vocab)
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    check_token_ids(prompt_ids, vocab, "prompt")
    if len(prompt_ids) >= limit:
        raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens; the context is {limit}", param="prompt")
    if len(prompt_ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"max_tokens={params.max_tokens} plus the prompt's {len(prompt_ids)} tokens exceeds the context of {limit}",
            param="max_tokens")


def check_token_ids(token_ids: list[int], vocab: int, param: str) -> None:
    """Raise InvalidRequestError naming `param` unless every id is an integer in [0, vocab) (a prompt's ids, or
    /detokenize's): the tokenizer's own error for an id outside its vocabulary is no message for a person."""
    outside = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if outside:
        raise InvalidRequestError(f"token ids must be integers in [0, {vocab}); got {outside[:5]}", param=param)
