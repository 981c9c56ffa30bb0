"""Lenient requests (like vLLM): unknown fields are ignored with one warning line per request (400 with
`--strict-requests`); documented fields that mean nothing here are no-ops, logged once at debug."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

from swaserve.server.errors import bad_request
from swaserve.server.protocol import ContentPart

logger = logging.getLogger("swaserve.server")

# request fields accepted and ignored (OpenAI's, vLLM's, llama.cpp's), by dotted path
NO_OPS = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
    "safety_identifier", "cache_prompt", "spaces_between_special_tokens", "priority", "request_id",
    "prediction", "verbosity", "web_search_options", "stream_options.include_obfuscation",
    "messages.refusal", "messages.annotations", "messages.audio", "include", "truncation",
    "background", "reasoning.summary", "reasoning.generate_summary", "text.verbosity", "max_tool_calls",
    # vLLM's structured-output options (server/guided.py): one grammar library here
    "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs.backend",
    "structured_outputs.disable_fallback", "structured_outputs.disable_any_whitespace",
    "structured_outputs.disable_additional_properties", "structured_outputs.whitespace_pattern",
})
_logged: set[str] = set()


def _walk(obj: Any, path: str, extras: list[str], used: list[str]) -> None:
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            value = getattr(obj, name)
            field_path = f"{path}.{name}" if path else name
            if value is not None and _generic(field_path) in NO_OPS:
                used.append(_generic(field_path))
            _walk(value, field_path, extras, used)
        for key in obj.model_extra or {}:
            if isinstance(obj, ContentPart) and key == obj.type:  # {"type": "image_url", "image_url": ...}
                continue
            extras.append(f"{path}.{key}" if path else key)
    elif isinstance(obj, list):
        for i, x in enumerate(obj):
            _walk(x, f"{path}[{i}]", extras, used)


def _generic(path: str) -> str:
    """messages[3].refusal -> messages.refusal"""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def scan_fields(body: BaseModel) -> tuple[list[str], list[str]]:
    """(unknown field paths, documented no-op fields used): a walk over every item of the body (20,000
    chat messages: hundreds of milliseconds), so never on the event loop."""
    extras: list[str] = []
    used: list[str] = []
    _walk(body, "", extras, used)
    return extras, used


def report_fields(extras: list[str], used: list[str], strict: bool, rid: str) -> None:
    """Warn about (or, strict, reject) unknown fields; log each no-op field once at debug."""
    if extras:
        if strict:
            raise bad_request(f"Unrecognized request argument supplied: {extras[0]} (not supported by this "
                              "server)", extras[0], "unsupported_parameter")
        logger.warning("%s: ignoring unknown field(s): %s", rid, ", ".join(extras))
    for name in used:
        if name not in _logged:
            _logged.add(name)
            logger.debug("request field %r is accepted and has no effect on this server", name)


def check_fields(body: BaseModel, strict: bool, rid: str) -> None:
    """scan_fields + report_fields."""
    report_fields(*scan_fields(body), strict, rid)
