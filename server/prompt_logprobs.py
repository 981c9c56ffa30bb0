"""Prompt logprobs in the response formats (the engine computes them: SamplingParams.prompt_logprobs).

* vLLM's `prompt_logprobs`: one entry per prompt token, the first null, each
  `{"<token id>": {"logprob", "rank", "decoded_token"}}` with the prompt token first, then the top-k
  (ranks 1..k; the prompt token once when it is among them). Completions put it on each choice, chat on
  the response (and, streamed, on the chunk that carries the choice's first output).
* The legacy completions `logprobs` of an echoed prompt (`echo` + `logprobs: N`), as OpenAI answered:
  `tokens`, `token_logprobs` (the first null), `top_logprobs` (the first null) and `text_offset` over
  the prompt, followed by the completion's.

Formatting a long prompt is CPU work: the routes run `format_prompt` on a worker thread (RouteCtx.prepare).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swaserve.engine.core import MAX_LOGPROBS, TokenLogprob
from swaserve.server.errors import bad_request
from swaserve.server.logprobs import TokenText, _lp

Entry = dict[str, dict[str, Any]]  # vLLM's: token id (a string) -> {logprob, rank, decoded_token}


@dataclass
class FormattedPrompt:
    """One choice's prompt logprobs in the formats its request asked for (None: not asked)."""

    vllm: list[Entry | None] | None
    echo: dict[str, list[Any]] | None


def vllm_entries(lps: list[TokenLogprob | None], text: TokenText, k: int) -> list[Entry | None]:
    """vLLM's `prompt_logprobs` list (the first entry None)."""
    out: list[Entry | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        tid = lp.token_id
        d = {str(tid): {"logprob": _lp(lp.logprob), "rank": lp.rank, "decoded_token": text(tid)}}
        for rank, (alt, v) in enumerate(lp.top[:k], 1):
            d.setdefault(str(alt), {"logprob": _lp(v), "rank": rank, "decoded_token": text(alt)})
        out.append(d)
    return out


def echo_entries(prompt_ids: list[int], lps: list[TokenLogprob | None], text: TokenText, k: int,
                 bos_added: bool) -> dict[str, list[Any]]:
    """The legacy `logprobs` of the prompt: the first token's logprob and alternatives are null. Offsets
    index the echoed text; a BOS the server added (not in the prompt's text) takes no width there."""
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for j, (tid, lp) in enumerate(zip(prompt_ids, lps)):
        t = text(tid)
        tokens.append(t)
        offsets.append(offset)
        if not (j == 0 and bos_added):
            offset += len(t)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
        else:
            token_lps.append(_lp(lp.logprob))
            tops.append({text(i): _lp(v) for i, v in lp.top[:k]} if k > 0 else None)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def format_prompt(prompt_ids: list[int], lps: list[TokenLogprob | None], text: TokenText, vllm_k: int | None,
                  echo_k: int | None, bos_added: bool = False) -> FormattedPrompt:
    """Both formats at once (a worker thread): vLLM's with top-`vllm_k`, the echo's with top-`echo_k`."""
    text.warm(ids_of(lps) + list(prompt_ids))
    return FormattedPrompt(
        vllm_entries(lps, text, vllm_k) if vllm_k is not None else None,
        echo_entries(prompt_ids, lps, text, echo_k, bos_added) if echo_k is not None else None)


def ids_of(lps: list[TokenLogprob | None]) -> list[int]:
    """The token ids the entries name (each token and its alternatives)."""
    out: list[int] = []
    for lp in lps:
        if lp is not None:
            out.append(lp.token_id)
            out.extend(i for i, _ in lp.top)
    return out


def engine_prompt_logprobs(echo_k: int | None, vllm_k: int | None) -> int | None:
    """The top-k the engine computes over the prompt for an echo's `logprobs` and vLLM's `prompt_logprobs`
    (the larger; None: neither asked); a 400 naming `prompt_logprobs` when it is out of range (vLLM's -1,
    the whole vocabulary, included)."""
    if vllm_k is not None and not 0 <= vllm_k <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the whole vocabulary, "
                          "-1, is not served)", "prompt_logprobs")
    ks = [k for k in (echo_k, vllm_k) if k is not None]
    return max(ks) if ks else None
