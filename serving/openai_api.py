"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (SSE when
`stream=true`), and vLLM's /tokenize and /detokenize. Every response names the weight versions
that produced it (`system_fingerprint`, and per choice the version runs) and its spec-decode
counters (`metrics.speculative_decoding`, vLLM's shape).

Completions with `best_of` sample best_of choices per prompt (with log-probs, shown only if asked
for) and return the n with the highest cumulative log-prob, best first, as vLLM's V0 engine did;
usage counts every sampled token."""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from jinja2 import TemplateError

from specrl.engine.validation import check_token_ids
from specrl.errors import InvalidRequestError, ModelNotFoundError, SpecrlError
from specrl.serving.generation import ChoiceStream, run_choices
from specrl.serving.protocol import (GENERATION, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                     DetokenizeRequest, TokenizeRequest, error_body, fingerprint, new_id, now, usage)
from specrl.speculation.quantities import SpecCounts

router = APIRouter(prefix="/v1")
tokens_router = APIRouter()  # vLLM's /tokenize and /detokenize


@router.get("/models")
async def models(request: Request):
    settings = request.app.state.settings
    return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": 0, "owned_by": "specrl",
                                        "root": settings.model, "parent": None,
                                        "max_model_len": settings.max_seq_len, "permission": []}]}


@router.post("/completions", responses=GENERATION)
async def completions(body: CompletionRequest, request: Request):
    _check_model(request, body.model)
    body.check_supported()
    tokenizer = request.app.state.loop.tokenizer
    prompts = _completion_prompts(body.prompt, tokenizer)
    for ids in prompts:  # before `echo` decodes them
        check_token_ids(ids, request.app.state.loop.vocab_size, "prompt")
    ranked = body.samples > body.n  # best_of: rank the samples by their log-probs
    logprobs = body.logprobs if body.logprobs is not None or not ranked else 0
    streams = []
    for i, p in enumerate(prompts):
        params = [body.sampling(body.max_tokens, logprobs, j) for j in range(body.samples)]
        echo = _prompt_text(body.prompt, i, p, tokenizer, params[0]) if body.echo else ""
        streams += [ChoiceStream(tokenizer, i * body.samples + j, p, params[j], chat=False, echo=echo,
                                 return_token_ids=body.return_token_ids, show_logprobs=body.logprobs is not None)
                    for j in range(body.samples)]
    return await _respond(request, body, streams, "text_completion", keep=body.n if ranked else None)


@router.post("/chat/completions", responses=GENERATION)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    _check_model(request, body.model)
    body.check_supported()
    tokenizer = request.app.state.loop.tokenizer
    prompt = _chat_prompt(body.messages, tokenizer)
    max_tokens = body.max_completion_tokens or body.max_tokens or request.app.state.settings.max_seq_len - len(prompt)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    streams = [ChoiceStream(tokenizer, j, prompt, body.sampling(max_tokens, logprobs, j), chat=True,
                            return_token_ids=body.return_token_ids) for j in range(body.n)]
    return await _respond(request, body, streams, "chat.completion")


@tokens_router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    """vLLM's: a completion prompt or chat messages -> the token ids the model would read."""
    if body.model is not None:
        _check_model(request, body.model)
    tokenizer = request.app.state.loop.tokenizer
    if body.messages is not None:
        tokens = _chat_prompt(body.messages, tokenizer, body.add_generation_prompt)
    elif body.prompt is not None:
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise InvalidRequestError("tokenize takes a prompt or messages", param="prompt")
    reply = {"count": len(tokens), "max_model_len": request.app.state.settings.max_seq_len, "tokens": tokens}
    if body.return_token_strs:
        reply["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
    return reply


@tokens_router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    """vLLM's: token ids -> their text."""
    if body.model is not None:
        _check_model(request, body.model)
    check_token_ids(body.tokens, request.app.state.loop.vocab_size, "tokens")
    return {"prompt": request.app.state.loop.tokenizer.decode(body.tokens)}


def _check_model(request: Request, name: str) -> None:
    served = request.app.state.settings.model
    if name != served:
        raise ModelNotFoundError(f"the model {name!r} does not exist; this server serves {served!r}")


def _chat_prompt(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True) -> list[int]:
    """Chat messages -> prompt token ids through the model's chat template. What the template refuses (a
    conversation it cannot render: its own `raise_exception`, an order of roles it does not take) is the
    caller's input, so a 400 naming `messages`, never a 500."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return list(tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                  return_dict=False))
    except (ValueError, TemplateError) as exc:
        raise InvalidRequestError(f"the model's chat template cannot render these messages: {exc}",
                                  param="messages") from None


def _prompt_text(prompt, i: int, ids: list[int], tokenizer, params) -> str:
    """What `echo` puts before completion i: the prompt as sent when it is text, else its decoded ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt[i]
    return tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=params.spaces_between_special_tokens)


def _best(streams: list[ChoiceStream], samples: int, n: int) -> list[ChoiceStream]:
    """best_of: per prompt (`samples` consecutive choices) the n with the highest cumulative
    log-prob, best first, renumbered."""
    shown = []
    for start in range(0, len(streams), samples):
        group = sorted(streams[start: start + samples], key=lambda c: c.cumulative_logprob, reverse=True)[:n]
        shown += group
    for index, choice in enumerate(shown):
        choice.index = index
    return shown


async def _respond(request: Request, body, streams: list[ChoiceStream], kind: str, keep: int | None = None):
    """keep: best_of's n (the best `keep` of each prompt's choices are returned; never streamed)."""
    loop, metrics = request.app.state.loop, request.app.state.metrics
    rid = new_id("chatcmpl" if kind == "chat.completion" else "cmpl")
    arrival = time.perf_counter()
    try:  # validation and saturation errors surface here, before any response starts
        for choice in streams:
            choice.submit(loop, f"{rid}-{choice.index}")
    except SpecrlError:
        for choice in streams:  # do not leave the choices already queued running for nobody
            if choice.seq is not None:
                loop.abort(choice.request_id)
        raise
    model = request.app.state.settings.model
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(loop, metrics, model, rid, kind, streams, include_usage, arrival),
                                 media_type="text/event-stream")
    await run_choices(loop, streams, metrics, arrival)
    metrics.requests.labels(kind, "ok").inc()
    shown = _best(streams, body.samples, keep) if keep is not None else streams
    return _final_body(model, rid, kind, streams, shown)


def _final_body(model: str, rid: str, kind: str, streams: list[ChoiceStream], shown: list[ChoiceStream]) -> dict:
    """streams: every choice run (usage, spec stats); shown: the choices returned."""
    last, stats = streams[-1], _spec_stats(streams, shown)
    return {"id": rid, "object": kind, "created": now(), "model": model,
            "system_fingerprint": fingerprint(last.target_version, last.drafter_version),
            "choices": [s.final_choice() for s in shown], "usage": _usage(streams),
            "specrl": stats, "metrics": {"speculative_decoding": stats["spec_decode"]}}


async def _sse(loop, metrics, model: str, rid: str, kind: str, streams: list[ChoiceStream], include_usage: bool,
               arrival: float):
    chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    events: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(run_choices(loop, streams, metrics, arrival, events))
    try:
        if kind == "chat.completion":
            for s in streams:
                yield _sse_line(_chunk(model, rid, chunk_kind, s, {"role": "assistant", "content": ""}, None, None))
        done = 0
        while done < len(streams):
            choice, delta, logprobs, finish = await events.get()
            if choice is None:  # the run failed: report it in-band, then end the stream
                yield _sse_line(error_body(str(delta), "server_error"))
                break
            payload = ({"content": delta} if kind == "chat.completion" else delta)
            yield _sse_line(_chunk(model, rid, chunk_kind, choice, payload, logprobs, finish))
            done += finish is not None
        if include_usage:
            yield _sse_line({"id": rid, "object": chunk_kind, "created": now(), "model": model,
                             "system_fingerprint": fingerprint(streams[-1].target_version, streams[-1].drafter_version),
                             "choices": [], "usage": _usage(streams), "specrl": _spec_stats(streams)})
        yield "data: [DONE]\n\n"
        metrics.requests.labels(kind, "ok").inc()
    finally:
        task.cancel()


def _chunk(model: str, rid: str, chunk_kind: str, choice: ChoiceStream, payload, logprobs, finish) -> dict:
    entry = {"index": choice.index, "logprobs": logprobs, "finish_reason": finish}
    entry.update({"delta": payload} if chunk_kind == "chat.completion.chunk" else {"text": payload})
    return {"id": rid, "object": chunk_kind, "created": now(), "model": model,
            "system_fingerprint": fingerprint(choice.target_version, choice.drafter_version), "choices": [entry]}


def _usage(streams: list[ChoiceStream]) -> dict:
    prompt_tokens = sum({id(s.prompt_ids): len(s.prompt_ids) for s in streams}.values())  # n choices share a prompt
    return usage(prompt_tokens, sum(len(s.token_ids) for s in streams))


def _spec_stats(streams: list[ChoiceStream], shown: list[ChoiceStream] | None = None) -> dict:
    """Counters over every choice run; version runs per choice returned (`shown`, default all)."""
    counts = SpecCounts()
    for s in streams:
        counts.add(s.spec)
    return {"target_version": streams[-1].target_version, "drafter_version": streams[-1].drafter_version,
            "versions": [s.version_runs for s in (streams if shown is None else shown)],
            "spec_decode": counts.to_dict()}


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if prompt and all(isinstance(p, str) for p in prompt):
        return [tokenizer.encode(p) for p in prompt]
    if prompt and all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, or token ids", param="prompt")


def _sse_line(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
