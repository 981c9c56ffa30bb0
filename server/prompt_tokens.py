"""Prompt text -> token ids for /v1/completions and /tokenize, within bounded memory.

A prompt of more than context_length * max_token_chars characters cannot fit and is a 400 at once
(server/prompt_limits.py). A long one (LONG_PROMPT_CHARS or more) is tokenized in a worker process
(server/chat/worker.py's, which already holds the tokenizer with the chat template) a piece at a time
(engine/text/long_text.py), and only its ids come back, as the bytes of an `array('i')`: the server's
process never holds the tokenizer's ~120 bytes per character, and for a completion the worker stops
once the ids exceed the context. A short prompt is tokenized on a worker thread, as before."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

from swaserve.engine.text.long_text import encode_long
from swaserve.server import json_out
from swaserve.server.chat import worker as chat_worker
from swaserve.server.errors import APIError
from swaserve.server.off_loop import run_cpu
from swaserve.server.prompt_limits import check_chars, check_tokens, context_error

if TYPE_CHECKING:
    from swaserve.server.state import ServerState

LONG_PROMPT_CHARS = 64 * 1024


def _encode_entry(key: int, setup: bytes | None, limits: tuple[float, int],
                  arg: tuple[str, bool, int | None, bool]) -> Any:
    """In a worker: (count, cut, ids) of the text with the template's tokenizer; ids as the bytes of an
    array('i'), or (as_json) of their JSON array."""
    template = chat_worker._worker_template(key, setup, limits)
    if template is None:
        return chat_worker.NEED_SETUP
    text, add_bos, stop_after, as_json = arg
    ids, cut = encode_long(template.tokenizer, text, add_bos, stop_after)
    if as_json:
        return len(ids), cut, ("[" + ",".join(map(str, ids)) + "]").encode()
    return len(ids), cut, ids.tobytes()


def _json_ids(tok: Any, text: str, add_bos: bool) -> tuple[int, bytes]:
    ids = tok.encode(text, add_bos=add_bos)
    return len(ids), json_out.dumps(ids)


async def _template_for(state: ServerState, tok: Any) -> Any:
    """The chat template whose worker-process copy has this tokenizer (None: tokenize here)."""
    try:
        template = state.chat_template()
    except APIError:  # no chat template: no tokenizer in the workers
        return None
    if template.tokenizer is not tok or await chat_worker._setup(template) is None:
        return None
    return template


async def encode_prompt(state: ServerState, tok: Any, text: str, add_bos: bool, context_length: int | None,
                        param: str = "prompt") -> list[int]:
    """Token ids of a completion's prompt `text`; 400 when it cannot fit `context_length` with room for
    one token (in characters, before tokenizing; then in tokens)."""
    if context_length is not None and len(text) > context_length:
        await run_cpu(check_chars, len(text), context_length, tok, param)  # the vocabulary walked once
    template = await _template_for(state, tok) if len(text) >= LONG_PROMPT_CHARS else None
    if template is None:
        ids = await run_cpu(tok.encode, text, add_bos=add_bos)
    else:
        arg = (text, add_bos, context_length, False)
        count, cut, blob = await chat_worker._call(_encode_entry, template, arg, heavy=True)
        if cut:
            raise context_error(f"the prompt has at least {count} tokens, which does not leave room for any "
                                f"completion within the context length of {context_length} tokens", param)
        ids = array("i", blob).tolist()
    check_tokens(len(ids), context_length, param)
    return ids


async def tokenize_json(state: ServerState, tok: Any, text: str, add_bos: bool,
                        context_length: int | None) -> tuple[int, bytes]:
    """(count, the JSON array of the ids) of /tokenize's `text`, the ids never a Python list here (a long
    text's come from the worker as JSON); 400 when it cannot fit `context_length` in characters."""
    if context_length is not None and len(text) > context_length:
        await run_cpu(check_chars, len(text), context_length, tok, "prompt")
    template = await _template_for(state, tok) if len(text) >= LONG_PROMPT_CHARS else None
    if template is None:
        return await run_cpu(_json_ids, tok, text, add_bos)
    count, _, blob = await chat_worker._call(_encode_entry, template, (text, add_bos, None, True), heavy=True)
    return count, blob
