"""The client suite (issue 27): what people run against an OpenAI-compatible server, with the clients
themselves, against the demo model: the openai SDK's parse helpers, vLLM's extra_body fields and the
deprecated functions API; LangChain's ChatOpenAI (structured output by both methods, bind_tools); the
OpenAI Agents SDK (a handoff, state carried across turns by previous_response_id).

The demo model writes random tokens, so every case that validates output constrains it with a grammar
(a schema, a forced tool call); the assertions are on shapes and validity, never on content. LangChain
and the Agents SDK come from the `test` extra; a framework that is not installed is skipped with the
reason."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from tests.server.conftest import SERVED, LiveServer
from tests.server.responses.test_store import reusable

MAX = 200


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    time: str = Field(max_length=10)
    sure: bool


class Move(BaseModel):
    """Numeric bounds inside tool arguments (the issue's first failure)."""

    model_config = ConfigDict(extra="forbid")
    direction: Literal["north", "south", "east", "west"]
    steps: int = Field(ge=-50, le=50)


USER = [{"role": "user", "content": "What time is it?"}]


# ---- openai SDK ------------------------------------------------------------------------------------
def test_openai_beta_chat_completions_parse(client: openai.OpenAI):
    r = client.beta.chat.completions.parse(model=SERVED, messages=USER, response_format=Answer,
                                           max_tokens=MAX, temperature=0.0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Answer)


def test_openai_chat_parse_with_a_pydantic_function_tool(client: openai.OpenAI):
    tool = openai.pydantic_function_tool(Move, name="move")
    r = client.chat.completions.parse(model=SERVED, messages=USER, tools=[tool], max_tokens=MAX,
                                      tool_choice={"type": "function", "function": {"name": "move"}},
                                      temperature=0.0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "move"
    assert isinstance(calls[0].function.parsed_arguments, Move)


def test_openai_responses_parse(client: openai.OpenAI):
    r = client.responses.parse(model=SERVED, input="What time is it?", text_format=Answer,
                               max_output_tokens=MAX, temperature=0.0)
    assert r.status == "completed" and isinstance(r.output_parsed, Answer)


def test_openai_vllm_guided_fields_through_extra_body(client: openai.OpenAI):
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=MAX, temperature=1.0,
                                       extra_body={"guided_regex": "[0-9]{2}:[0-9]{2}"})
    assert re.fullmatch("[0-9]{2}:[0-9]{2}", r.choices[0].message.content)
    r = client.completions.create(model=SERVED, prompt="Pick one:", max_tokens=MAX,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert r.choices[0].text in ("red", "green", "blue")
    so = {"structured_outputs": {"json": Answer.model_json_schema()}}
    r = client.chat.completions.create(model=SERVED, messages=USER, max_tokens=MAX, temperature=0.0,
                                       extra_body=so)
    Answer.model_validate_json(r.choices[0].message.content)


def test_openai_legacy_functions(client: openai.OpenAI):
    fn = {"name": "move", "description": "Move", "parameters": Move.model_json_schema()}
    r = client.chat.completions.create(model=SERVED, messages=USER, functions=[fn], max_tokens=MAX,
                                       function_call={"name": "move"}, temperature=0.0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call" and not msg.tool_calls
    assert msg.function_call.name == "move" and isinstance(json.loads(msg.function_call.arguments), dict)


def test_openai_responses_previous_response_id(client: openai.OpenAI):
    first = client.responses.create(model=SERVED, input="Remember: 42.", max_output_tokens=8, temperature=0.0)
    again = client.responses.create(model=SERVED, input="What was it?", previous_response_id=first.id,
                                    max_output_tokens=8, temperature=0.0)
    assert again.previous_response_id == first.id
    assert again.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens // 2
    assert client.responses.retrieve(first.id).id == first.id


# ---- LangChain -------------------------------------------------------------------------------------
def _chat_openai(server: LiveServer) -> Any:
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (test extra)")
    return lc.ChatOpenAI(model=SERVED, base_url=server.url + "/v1", api_key="unused", temperature=0.0,
                         max_tokens=MAX, max_retries=0, timeout=300)


def test_langchain_structured_output_json_schema(server: LiveServer):
    out = _chat_openai(server).with_structured_output(Answer, method="json_schema").invoke("What time is it?")
    assert isinstance(out, Answer)


def test_langchain_structured_output_function_calling(server: LiveServer):
    llm = _chat_openai(server).with_structured_output(Move, method="function_calling")
    assert isinstance(llm.invoke("Which way?"), Move)


def test_langchain_bind_tools(server: LiveServer):
    from langchain_core.tools import tool

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    msg = _chat_openai(server).bind_tools([get_time], tool_choice="get_time").invoke("Time in Berlin?")
    assert len(msg.tool_calls) == 1 and msg.tool_calls[0]["name"] == "get_time"
    assert msg.tool_calls[0]["args"]["zone"] in ("UTC", "CET") and msg.tool_calls[0]["id"]


# ---- the OpenAI Agents SDK -------------------------------------------------------------------------
def _agents() -> Any:
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (test extra)")
    agents.set_tracing_disabled(True)
    return agents


def _run(server: LiveServer, body: Callable[[Any, Any], Awaitable[Any]]) -> Any:
    """body(agents module, a Responses or chat model factory) on a fresh loop, its client closed after."""
    ag = _agents()

    async def main() -> Any:
        async with server.async_client() as client:
            def model(kind: str = "responses") -> Any:
                cls = ag.OpenAIResponsesModel if kind == "responses" else ag.OpenAIChatCompletionsModel
                return cls(model=SERVED, openai_client=client)
            return await body(ag, model)

    return asyncio.run(main())


def _settings(ag: Any, **kw: Any) -> Any:
    return ag.ModelSettings(temperature=0.0, max_tokens=MAX, **kw)


def test_agents_sdk_handoff(server: LiveServer):
    async def body(ag: Any, model: Callable[..., Any]) -> Any:
        clock = ag.Agent(name="Clock", instructions="Tell the time.", model=model(), output_type=Answer,
                         model_settings=_settings(ag))
        triage = ag.Agent(name="Triage", instructions="Hand off to the clock.", model=model(),
                          handoffs=[clock], model_settings=_settings(ag, tool_choice="required"))
        return await ag.Runner.run(triage, "What time is it?", max_turns=4)

    result = _run(server, body)
    assert result.last_agent.name == "Clock" and isinstance(result.final_output, Answer)


def test_agents_sdk_chat_completions_model(server: LiveServer):
    async def body(ag: Any, model: Callable[..., Any]) -> Any:
        agent = ag.Agent(name="Clock", instructions="Tell the time.", model=model("chat"), output_type=Answer,
                         model_settings=_settings(ag))
        return await ag.Runner.run(agent, "What time is it?")

    assert isinstance(_run(server, body).final_output, Answer)


def test_agents_sdk_state_across_turns(server: LiveServer):
    async def body(ag: Any, model: Callable[..., Any]) -> Any:
        agent = ag.Agent(name="Clock", instructions="Tell the time.", model=model(), output_type=Answer,
                         model_settings=_settings(ag))
        first = await ag.Runner.run(agent, "What time is it in Berlin?")
        second = await ag.Runner.run(agent, "And in Paris?", previous_response_id=first.last_response_id)
        return first, second

    first, second = _run(server, body)
    assert isinstance(second.final_output, Answer)
    u1, u2 = first.raw_responses[-1].usage, second.raw_responses[-1].usage
    # the second turn's prompt holds the first turn (input and output), which the prefix cache reuses
    assert u2.input_tokens > u1.input_tokens + u1.output_tokens // 2
    turn = [{"role": "system", "content": "Tell the time."},
            {"role": "user", "content": "What time is it in Berlin?"}]
    assert u2.input_tokens_details.cached_tokens >= reusable(server, turn) > 0
