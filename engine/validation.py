"""The one validation of a request, whatever the way in: the core's make_requests (offline use, the
in-process front) and the engine-process front before anything is sent (so that a bad request fails
with a 400 before any output). Errors are RequestError naming the field. Importing this module does not
import torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swaserve.engine.core import GrammarSpec, RequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against."""

    vocab_size: int  # the tokenizer's: ids the sampling fields may name (logit_bias, stop_token_ids, top_k)
    model_vocab_size: int  # the model's embedding rows: ids a prompt may hold
    context_length: int


def check_lengths(prompt_len: int, params: SamplingParams, context_length: int) -> int:
    """Validate the prompt and max_tokens against the context; returns the max total length."""
    if prompt_len == 0:
        raise RequestError("the prompt is empty", "prompt")
    if prompt_len >= context_length:
        raise RequestError(
            f"the prompt has {prompt_len} tokens, which does not leave room for any completion within "
            f"the context length of {context_length} tokens")
    room = context_length - prompt_len  # the most a completion can have
    if params.max_tokens is None:
        if params.min_tokens > room:
            raise RequestError(
                f"min_tokens is {params.min_tokens}, but this model's context length is {context_length} "
                f"tokens and the prompt has {prompt_len}: at most {room} can be generated", "min_tokens")
        return context_length
    if prompt_len + params.max_tokens > context_length:
        raise RequestError(
            f"this model's context length is {context_length} tokens, but {prompt_len + params.max_tokens} "
            f"were requested ({prompt_len} in the prompt, {params.max_tokens} in max_tokens)", "max_tokens")
    return prompt_len + params.max_tokens


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits,
                     check_grammar: Callable[[GrammarSpec], None] | None = None) -> int:
    """Raise RequestError for a bad request: sampling fields, then the grammar (`check_grammar`, where the
    grammar backend is: the engine's process), then the prompt's ids and the lengths. Returns the max
    total length (prompt + completion)."""
    params.validate(limits.vocab_size)
    if params.grammar is not None and check_grammar is not None:
        check_grammar(params.grammar)  # compiles (ms; cached by spec)
    # min / max, not a Python loop: a front runs this on the HTTP event loop (200k ids: 2 ms, not 50+)
    if prompt_ids and not (0 <= int(min(prompt_ids)) and int(max(prompt_ids)) < limits.model_vocab_size):
        raise RequestError("the prompt contains token ids outside the vocabulary", "prompt")
    return check_lengths(len(prompt_ids), params, limits.context_length)
