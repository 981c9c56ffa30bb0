"""OpenAI request models (pydantic), lenient like vLLM's.

Every field OpenAI documents is declared (those that mean nothing here are no-ops, see
server/leniency.py), plus the vLLM / SGLang / llama.cpp extensions clients send. Unknown fields are
kept in `model_extra`: the routes log them in one warning line, or answer 400 naming the first one with
`--strict-requests`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator
from pydantic_core import PydanticCustomError

# after json.loads a valid surrogate pair is one character: what is left in this range is a lone half,
# which is not Unicode (it cannot be encoded as UTF-8, so it could not be echoed, logged or rendered)
_SURROGATE = re.compile("[\ud800-\udfff]")


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


def lone_surrogate_path(obj: Any, path: str = "") -> str | None:
    """The path (`messages[0].content`) of the first string, key included, holding a lone surrogate."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, str):
            if _SURROGATE.search(x):
                return at or "body"
        elif isinstance(x, dict):
            for k, v in reversed(list(x.items())):
                if isinstance(k, str) and _SURROGATE.search(k):
                    return at or "body"
                stack.append((v, f"{at}.{k}" if at else str(k)))
        elif isinstance(x, list):
            stack.extend((v, f"{at}[{i}]") for i, v in reversed(list(enumerate(x))))
    return None


class RequestBody(Lenient):
    """A whole request body: lone UTF-16 surrogates (`"\\ud800"` without its pair) are refused, naming
    where they are, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        try:  # one C-speed pass; the path is looked for only when there is a surrogate
            json.dumps(data, ensure_ascii=False).encode("utf-8")
            return data
        except UnicodeEncodeError:
            at = lone_surrogate_path(data)
        except (TypeError, ValueError):  # not plain JSON data: let the fields' validation speak
            return data
        if at is not None:
            raise PydanticCustomError(
                "lone_surrogate", "{where} contains a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                "without its pair), which is not valid Unicode", {"where": at})
        return data


class StreamOptions(Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # no-op


class ContentPart(Lenient):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # chat: {"url", "detail"}; Responses input_image: the url
    detail: str | None = None  # Responses input_image
    file_id: str | None = None  # Responses input_image (refused: no Files API)


class ToolCallFunction(Lenient):
    name: str
    arguments: str | dict[str, Any] | None = "{}"


class ToolCallIn(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction
    index: int | None = None


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # echoed back by clients that append a previous response message (`.model_dump()`): no-ops
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None  # deprecated form of one tool call


# what a Gemma tool call can carry as a name (`call:NAME{`, read back by server/chat/tool_parser.py): more
# than OpenAI's ^[a-zA-Z0-9_-]{1,64}$ (dots, colons, quotes, any length), no whitespace, braces, <, > or |
TOOL_NAME = re.compile(r"[^\s{}<>|]+")


class FunctionDef(Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _writable(cls, name: str) -> str:
        if name and not TOOL_NAME.fullmatch(name):
            raise PydanticCustomError(
                "tool_name", "tool name {name} cannot be written in a Gemma tool call (no whitespace, "
                "braces, '<', '>' or '|'; OpenAI's rule is letters, digits, '_' and '-', at most 64)",
                {"name": repr(name)})
        return name


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(Lenient):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs` object (server/guided.py): one of json, regex, choice, grammar,
    json_object; the rest are accepted."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # refused (400)
    # no-ops (server/leniency.py)
    backend: str | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


class GuidedFields(Lenient):
    """vLLM's structured-output request fields, on chat and completions (server/guided.py)."""

    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # no-ops (server/leniency.py)
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class SamplingFields(RequestBody):
    """Fields shared by chat and completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: StrictBool = False  # "yes" / 1 are refused, not read as true
    stream_options: StreamOptions | None = None
    # no-ops (see server/leniency.py NO_OPS)
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    cache_prompt: bool | None = None  # llama.cpp: the prefix cache is always on
    spaces_between_special_tokens: bool | None = None
    priority: int | None = None
    request_id: str | None = None


class ChatCompletionRequest(SamplingFields, GuidedFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None  # none / minimal -> thinking off, else on
    # deprecated OpenAI function calling: mapped to tools / tool_choice
    functions: list[FunctionDef] | None = None
    function_call: str | NamedFunction | None = None
    # vLLM chat extensions
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM: the prompt tokens' logprobs, top-k (server/prompt_logprobs.py)
    # no-ops or refused when set to something (server/leniency.py)
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None


PromptType = str | list[int] | list[list[int]] | list[str]


class CompletionRequest(SamplingFields, GuidedFields):
    prompt: PromptType
    max_tokens: int | None = 16
    logprobs: int | None = None  # with echo: also over the prompt (the first token null)
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM: the prompt tokens' logprobs, top-k (server/prompt_logprobs.py)
    best_of: int | None = None
    suffix: str | None = None


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]
