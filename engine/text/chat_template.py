"""Chat template rendering in a jinja2 sandbox (a GGUF's `tokenizer.chat_template` is untrusted).

The environment matches what HF-style templates expect (trim_blocks, lstrip_blocks, loop controls,
`raise_exception`, `tojson`, `strftime_now`, the `{% generation %}` tag) but is an
`ImmutableSandboxedEnvironment` with no loader: no Python internals, no files, no mutation.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload

import jinja2

from swaserve.engine.text.template_sandbox import (
    RenderLimit,
    RenderLimits,
    make_environment,
    render_bounded,
    render_budget,
)


class TemplateTokenizer(Protocol):
    """What rendering needs of a tokenizer (engine/text/tokenizer.py's Tokenizer is one)."""

    bos_token: str
    eos_token: str
    bos_id: int
    add_bos_token: bool

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text (no BOS added) with each token's (start, end) character span."""
        ...

ROLES = ("system", "developer", "user", "assistant", "tool")
MODEL_TEMPLATE = "the model's chat template (tokenizer.chat_template)"  # the default name, in errors


@dataclass
class ChatPrompt:
    text: str
    token_ids: list[int]
    message_starts: list[int]  # token offset where message i starts
    char_starts: list[int] = field(default_factory=list)  # character offset where message i starts


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise ValueError(f"{where}: content part {j} must be an object")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"{where}: content part type {kind!r} is not supported (only 'text')")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError(f"{where}: content part {j} needs a string 'text'")
            texts.append(text)
        return "\n".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts")


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of OpenAI-style messages; content parts are joined into one string."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object")
        m = {k: v for k, v in m.items() if v is not None or k == "content"}
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        calls = m.get("tool_calls")
        if calls is not None and role != "assistant":
            raise ValueError(f"{where}: only assistant messages may have tool_calls")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise ValueError(f"{where}: {role} message needs content")
            m["content"] = ""
        else:
            m["content"] = _text_of(content, where)
        if calls is not None:
            m["tool_calls"] = [_normalize_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        out.append(m)
    return out


def _normalize_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"{where} must be an object with a 'function'")
    fn = dict(call["function"])
    if not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function needs a string 'name'")
    args = fn.get("arguments")
    if args is None:
        fn["arguments"] = {}
    elif isinstance(args, str):
        try:  # OpenAI sends arguments as a JSON string; templates format the object
            parsed = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    elif not isinstance(args, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON object or string")
    out = dict(call)
    out["function"] = fn
    out.setdefault("type", "function")
    return out


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    if not isinstance(tools, Sequence) or isinstance(tools, str):
        raise ValueError("tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ValueError(f"tools[{i}] must be an object")
        if "function" not in t and isinstance(t.get("name"), str):
            t = {"type": "function", "function": dict(t)}
        fn = t.get("function")
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}] needs a 'function' with a string 'name'")
        out.append(dict(t))
    return out


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[:hi+1] != b[:hi+1] or hi is the end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class ChatTemplate:
    """A compiled chat template bound to a tokenizer."""

    def __init__(self, template_source: str, tokenizer: TemplateTokenizer,
                 name: str = MODEL_TEMPLATE,
                 limits: RenderLimits | None = None) -> None:
        if not isinstance(template_source, str) or not template_source.strip():
            raise ValueError("chat template is empty")
        self.source = template_source
        self.name = name  # in error messages (the server's 400s)
        self.limits = limits or RenderLimits()  # one render's time and size (engine/text/template_sandbox.py)
        self.tokenizer = tokenizer
        try:
            self._template = make_environment().from_string(template_source)
            self._lenient = make_environment(jinja2.ChainableUndefined).from_string(template_source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template syntax error (line {e.lineno}): {e.message}") from None
        self.max_exact_messages = 16  # starts of earlier messages (except 0, 1) copy the previous one
        self._cache: OrderedDict[tuple[str, bytes], str | None] = OrderedDict()
        self._cache_chars = 0
        self._headers_cache: dict[bytes, dict[str, str]] = {}
        self._lock = threading.Lock()

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, /, **kwargs: Any) -> str:
        """Render already-normalized messages to text (no validation). The template variables in `kwargs`
        may have any name (`self` included): the parameters before it are positional-only."""
        return self._render(self._template, messages, tools, add_generation_prompt, kwargs)

    def _render(self, template: jinja2.Template, messages: list[dict[str, Any]], tools: Any,
                add_generation_prompt: bool, kwargs: dict[str, Any]) -> str:
        ctx = dict(kwargs)
        ctx.update(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token,
        )
        try:
            return render_bounded(template, ctx, self.limits)
        except RenderLimit as e:
            raise RenderLimit(f"chat template error: {e}") from None
        except jinja2.TemplateError as e:  # includes SecurityError and raise_exception()
            raise ValueError(f"chat template error: {e.message or type(e).__name__}") from None
        except (TypeError, AttributeError, LookupError, ValueError, ArithmeticError, RecursionError) as e:
            raise ValueError(f"chat template error: {type(e).__name__}: {e}") from None

    def render(self, messages: Any, /, tools: Any = None, add_generation_prompt: bool = True,
               **kwargs: Any) -> ChatPrompt:
        """Render, tokenize, and locate the token offset at which each message starts (`kwargs`: template
        variables, e.g. a request's chat_template_kwargs; `self` and `messages` among them do not clash
        with the positional-only parameters)."""
        msgs = normalize_messages(messages)
        tls = normalize_tools(tools)
        with render_budget(self.limits):  # the render and its message-start probes share one deadline
            text = self.render_text(msgs, tls, add_generation_prompt, **kwargs)
            chars = self._char_starts(msgs, tls, text, kwargs)
        tok = self.tokenizer
        ids, spans = tok.encode_with_offsets(text)
        shift = 0
        if tok.add_bos_token and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
            shift = 1
        ends = [e for _, e in spans]
        # token containing (or starting at) each character offset: rounds down inside a token
        starts = [shift + bisect.bisect_right(ends, c) for c in chars]
        return ChatPrompt(text=text, token_ids=ids, message_starts=starts, char_starts=chars)

    # -- message starts ---------------------------------------------------------------------------
    def _prefix_render(self, kind: str, msgs: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any],
                       key: bytes) -> str | None:
        """Cached render of a partial conversation without generation prompt (None if it fails)."""
        ck = (kind, key)
        with self._lock:
            if ck in self._cache:
                self._cache.move_to_end(ck)
                return self._cache[ck]
        try:
            if kind == "empty":  # `messages[0]...` on [] must not fail here
                out: str | None = self._render(self._lenient, [], tools, False, kwargs)
            elif kind == "probe":
                out = self._render(self._template, [*msgs, _PROBE], tools, False, kwargs)
            else:
                out = self._render(self._template, msgs, tools, False, kwargs)
        except RenderLimit:
            raise  # over the budget: the whole render fails
        except ValueError:
            out = None
        with self._lock:
            if ck not in self._cache:
                self._cache[ck] = out
                self._cache_chars += len(out or "")
            while self._cache_chars > _CACHE_CHARS and self._cache:
                _, old = self._cache.popitem(last=False)
                self._cache_chars -= len(old or "")
        return out

    def _headers(self, tools: Any, kwargs: dict[str, Any], ctx: bytes) -> dict[str, str]:
        """Text the template puts before a message's content, per role (after a user message)."""
        hit = self._headers_cache.get(ctx)
        if hit is not None:
            return hit
        out: dict[str, str] = {}
        first = {"role": "user", "content": "\x01"}
        try:
            base = self._render(self._template, [first], tools, False, kwargs)
        except RenderLimit:
            raise
        except ValueError:
            base = None
        for role in ROLES:
            if base is None or role == "tool":
                continue
            try:
                pair = [first, {"role": role, "content": "\x02"}]
                x = self._render(self._template, pair, tools, False, kwargs)
            except RenderLimit:
                raise
            except ValueError:
                continue
            start, end = _common_prefix_len(base, x), x.find("\x02")
            if 0 <= start <= end:
                out[role] = x[start:end]
        if len(self._headers_cache) > 64:
            self._headers_cache.clear()
        self._headers_cache[ctx] = out
        return out

    def _char_starts(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                     text: str, kwargs: dict[str, Any]) -> list[int]:
        """Character offset where each message starts in `text`.

        Message i starts where a render of messages[:i] stops agreeing with the full render. When
        the template renders earlier messages differently depending on later ones (Gemma 4 shows
        the thinking of a tool-call turn only after the last user message), a render of
        messages[:i] plus a user probe is tried too; a role header the full text shares with a
        probe (`<|turn>user\n`, or part of one) is not counted as agreement.
        """
        n = len(msgs)
        ctx = _digest(json.dumps([tools, kwargs], sort_keys=True, default=str).encode())
        headers = self._headers(tools, kwargs, ctx)
        exact = set(range(min(n, 2))) | set(range(max(0, n - self.max_exact_messages), n))
        keys = [ctx]
        for m in msgs:
            keys.append(_digest(keys[-1] + json.dumps(m, sort_keys=True, default=str).encode()))
        out: list[int] = []
        for i in range(n):
            if i not in exact:
                out.append(out[-1])
                continue
            bos = self.tokenizer.bos_token
            head = headers.get(msgs[i]["role"], "")
            if i == 0 and msgs[0]["role"] in ("system", "developer"):  # opens the text (with tools etc.)
                out.append(len(bos) if bos and text.startswith(bos) else 0)
                continue
            cands = []
            a_text = self._prefix_render("empty" if i == 0 else "plain", msgs[:i], tools, kwargs, keys[i])
            a = _common_prefix_len(a_text, text) if a_text is not None else -1
            if a >= 0:
                cands.append(_back_off(text, a, head))
            if a_text is None or a < len(a_text):
                b_text = self._prefix_render("probe", msgs[:i], tools, kwargs, keys[i])
                if b_text is not None:
                    cands.append(_back_off(text, _common_prefix_len(b_text, text), head))
            c = max(cands) if cands else (len(bos) if bos and text.startswith(bos) else 0)
            out.append(max(c, out[-1]) if out else c)
        return out


@overload
def build_chat_template(source: str, tokenizer: TemplateTokenizer, limits: RenderLimits | None = ...,
                        name: str = ...) -> ChatTemplate: ...


@overload
def build_chat_template(source: None, tokenizer: TemplateTokenizer, limits: RenderLimits | None = ...,
                        name: str = ...) -> None: ...


def build_chat_template(source: str | None, tokenizer: TemplateTokenizer, limits: RenderLimits | None = None,
                        name: str = MODEL_TEMPLATE) -> ChatTemplate | None:
    """The one way a ChatTemplate is made (the engine, the engine-process front, the server's
    --chat-template, the chat workers): None for no source; ValueError when it is empty or does not
    compile. `limits`: the render budget (None: the module defaults); `name`: in error messages."""
    if source is None:
        return None
    return ChatTemplate(source, tokenizer, name=name, limits=limits)


def model_chat_template(metadata: Mapping[str, Any], tokenizer: TemplateTokenizer,
                        limits: RenderLimits | None = None) -> ChatTemplate | None:
    """The GGUF's `tokenizer.chat_template` (None when it has none, or an empty one)."""
    return build_chat_template(metadata.get("tokenizer.chat_template") or None, tokenizer, limits)


_PROBE = {"role": "user", "content": "\x00swaserve-probe\x00"}
_CACHE_CHARS = 16_000_000


def _digest(b: bytes) -> bytes:
    return hashlib.blake2b(b, digest_size=16).digest()


def _back_off(text: str, c: int, head: str) -> int:
    """Move c back over the part of a role header that ends at c (the header opens the message)."""
    for k in range(min(len(head), c), 0, -1):
        if text.startswith(head[:k], c - k):
            return c - k
    return c
