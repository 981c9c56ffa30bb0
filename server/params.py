"""Request fields -> SamplingParams, with the model's sampling defaults.

What a request that sets no sampling field gets, in order of precedence (first wins):
  1. the request's own fields;
  2. `--default-sampling KEY=VALUE,...` (or vLLM's `--override-generation-config '{"KEY": VALUE}'`);
  3. the GGUF's generation metadata (`general.sampling.temp`, `.top_k`, `.top_p`, `.min_p`,
     `.penalty_repeat`, written by llama.cpp's converters from generation_config.json);
  4. Gemma 4's published defaults: temperature 1.0, top_k 64, top_p 0.95;
  5. SamplingParams' own defaults (min_p 0, no penalties).
"""

from __future__ import annotations

import json
from typing import Any

from swaserve.engine.core import RequestError, SamplingParams
from swaserve.server.errors import APIError, bad_request
from swaserve.server.protocol import SamplingFields

DEFAULT_MAX_STOP = 4  # stop strings per request, as OpenAI (--max-stop-sequences)
GEMMA4_DEFAULTS: dict[str, float] = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
# keys --default-sampling takes (HF generation_config / vLLM spellings map to ours)
DEFAULT_KEYS: dict[str, str] = {
    "temperature": "temperature", "temp": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "max_tokens": "max_tokens", "max_new_tokens": "max_tokens",
}
_INTS = {"top_k", "max_tokens"}


def parse_default_sampling(text: str | None) -> dict[str, float]:
    """`temperature=0.7,top_k=20` or a JSON object -> {field: value}; ValueError naming a bad entry."""
    if not text or not text.strip():
        return {}
    items: list[tuple[str, Any]]
    if text.strip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--default-sampling: not a JSON object: {e}") from None
        if not isinstance(obj, dict):
            raise ValueError("--default-sampling: not a JSON object")
        items = list(obj.items())
    else:
        items = []
        for part in text.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"--default-sampling: expected KEY=VALUE, got {part.strip()!r}")
            items.append((key.strip(), value.strip()))
    out: dict[str, float] = {}
    for key, value in items:
        name = DEFAULT_KEYS.get(key)
        if name is None:
            known = ", ".join(sorted(DEFAULT_KEYS))
            raise ValueError(f"--default-sampling: unknown key {key!r} (known: {known})")
        try:
            out[name] = int(value) if name in _INTS else float(value)
        except (TypeError, ValueError):
            raise ValueError(f"--default-sampling: {key} must be a number, got {value!r}") from None
    try:
        _defaults_params(out).validate(1 << 30)
    except RequestError as e:
        raise ValueError(f"--default-sampling: {e}") from None
    return out


def _defaults_params(defaults: dict[str, float]) -> SamplingParams:
    d = {k: v for k, v in defaults.items() if k != "max_tokens"}
    if "top_k" in d and d["top_k"] == 0:
        d["top_k"] = -1
    return SamplingParams(**d)


def merge_defaults(gguf: dict[str, float], flag: dict[str, float]) -> dict[str, float]:
    """Gemma 4's published defaults, then the GGUF's values, then the flag's (later wins, per key)."""
    return {**GEMMA4_DEFAULTS, **gguf, **flag}


def build_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                 defaults: dict[str, float] | None = None, rename: dict[str, str] | None = None,
                 max_stop: int = DEFAULT_MAX_STOP, min_max_tokens: int = 1, **extra: Any) -> SamplingParams:
    """Request fields over `defaults` -> SamplingParams; 400 naming the field (SamplingParams name ->
    `rename`d). `max_stop`: --max-stop-sequences. `min_max_tokens`: 0 where a request may only prefill
    (completions' echo). `extra`: further SamplingParams fields (grammar, special-token handling, prompt
    logprobs)."""
    defaults = defaults or {}
    if max_tokens is not None and max_tokens < min_max_tokens:
        name = (rename or {}).get("max_tokens", "max_tokens")
        raise APIError(400, f"{name} must be at least {min_max_tokens}", name, "invalid_value")
    stop: tuple[str, ...] = ()
    if isinstance(req.stop, str):
        stop = (req.stop,) if req.stop else ()
    elif req.stop:
        stop = tuple(s for s in req.stop if s)
    if len(stop) > max_stop:
        raise APIError(400, f"stop takes at most {max_stop} strings (this server's --max-stop-sequences), "
                       f"got {len(stop)}", "stop", "invalid_value")
    bias: list[tuple[int, float]] = []
    for k, v in (req.logit_bias or {}).items():
        try:
            tid = int(k)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
        if not -100.0 <= v <= 100.0:
            raise bad_request(f"logit_bias values must be in [-100, 100], got {v}", "logit_bias")
        bias.append((tid, float(v)))

    def pick(name: str, fallback: float) -> Any:
        v = getattr(req, name)
        return v if v is not None else defaults.get(name, fallback)

    top_k = pick("top_k", -1)
    if max_tokens is None and "max_tokens" in defaults:
        max_tokens = int(defaults["max_tokens"])
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(pick("temperature", 1.0)),
            top_p=float(pick("top_p", 1.0)),
            top_k=-1 if top_k in (None, 0) else int(top_k),
            min_p=float(pick("min_p", 0.0)),
            presence_penalty=float(pick("presence_penalty", 0.0)),
            frequency_penalty=float(pick("frequency_penalty", 0.0)),
            repetition_penalty=float(pick("repetition_penalty", 1.0)),
            seed=req.seed,
            stop=stop,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            logit_bias=tuple(bias),
            n=req.n,
            min_tokens=req.min_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            **extra,
        )
        params.validate(vocab_size)
    except RequestError as e:
        param = (rename or {}).get(e.param or "", e.param)
        msg = str(e) if param == e.param or not e.param or not param else str(e).replace(e.param, param)
        raise APIError(400, msg, param, "invalid_value") from None
    return params
