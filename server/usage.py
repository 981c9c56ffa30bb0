"""The `usage` object of completion and chat answers: token counts, and the cached prompt tokens when
the server reports them (`--enable-cache-report`)."""

from __future__ import annotations

from typing import Any


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               report: bool) -> dict[str, Any]:
    u: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if report:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u
