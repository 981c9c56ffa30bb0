"""The one validation of a request, whatever the way in: the core's make_requests (offline use, the
in-process front) and the engine-process front before anything is sent (so that a bad request fails
with a 400 before any output). Errors are RequestError naming the field. Importing this module does not
import torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swaserve.engine.core import GrammarSpec, ImageInput, RequestError, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against."""

    vocab_size: int  # the tokenizer's: ids the sampling fields may name (logit_bias, stop_token_ids, top_k)
    model_vocab_size: int  # the model's embedding rows: ids a prompt may hold
    context_length: int
    images: bool = False  # an image encoder is loaded


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


def check_images(prompt_len: int, images: Sequence[ImageInput], loaded: bool) -> None:
    """Image spans: an encoder to run them, in order, disjoint, inside the prompt, one pixel row per patch."""
    if not loaded:
        raise RequestError("this model has no image encoder (start the server with --mmproj FILE)",
                           "messages")
    end = 0
    for i, im in enumerate(images):
        if im.length < 1 or im.offset < end or im.offset + im.length > prompt_len:
            raise RequestError(f"image {i}: its span [{im.offset}, {im.offset + im.length}) is not in order "
                               f"inside the prompt of {prompt_len} tokens", "messages")
        if len(im.pixel_values) != len(im.position_ids) or len(im.pixel_values) == 0:
            raise RequestError(f"image {i}: {len(im.pixel_values)} patches but {len(im.position_ids)} "
                               "positions", "messages")
        end = im.offset + im.length


def validate_request(prompt_ids: Sequence[int], params: SamplingParams, limits: RequestLimits,
                     check_grammar: Callable[[GrammarSpec], None] | None = None,
                     images: Sequence[ImageInput] = ()) -> int:
    """Raise RequestError for a bad request: sampling fields, then the grammar (`check_grammar`, where the
    grammar backend is: the engine's process), then the prompt's ids and the lengths. Returns the max
    total length (prompt + completion)."""
    params.validate(limits.vocab_size)
    if params.grammar is not None and check_grammar is not None:
        check_grammar(params.grammar)  # compiles (ms; cached by spec)
    # min / max, not a Python loop: a front runs this on the HTTP event loop (200k ids: 2 ms, not 50+)
    if prompt_ids and not (0 <= int(min(prompt_ids)) and int(max(prompt_ids)) < limits.model_vocab_size):
        raise RequestError("the prompt contains token ids outside the vocabulary", "prompt")
    if images:
        check_images(len(prompt_ids), images, limits.images)
        if params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not supported for a prompt with images", "prompt_logprobs")
    return check_lengths(len(prompt_ids), params, limits.context_length)
