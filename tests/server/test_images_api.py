"""Images over HTTP with the official openai client, on the demo model and its own image encoder: chat
image_url parts streamed and not, reuse of a shared image, no reuse of a different one, bad images as
400s naming the part, the Responses API's input_image, the inspector's image spans."""

from __future__ import annotations

import base64
import io
from typing import Any

import openai
import pytest
from PIL import Image

from tests.server.conftest import SERVED, greedy, wait_idle

PAGE = 16


def data_url(color: tuple[int, int, int], size: tuple[int, int] = (64, 48), fmt: str = "PNG") -> str:
    img = Image.new("RGB", size, color)
    for x in range(0, size[0], 7):  # some structure, so that the encoder sees more than a flat colour
        img.putpixel((x, x % size[1]), (255 - color[0], 0, color[2]))
    buf = io.BytesIO()
    img.save(buf, fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


SYSTEM = "You are a careful assistant. Look at the picture and answer the question in one sentence."


def ask(client: openai.OpenAI, url: str, question: str, stream: bool = False, **kw: Any) -> Any:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url, "detail": "auto"}},
                    {"type": "text", "text": question}]}]
    return client.chat.completions.create(model=SERVED, messages=messages, max_tokens=8, stream=stream,
                                          **greedy(), **kw)


def test_image_chat_streamed_and_not(client: openai.OpenAI, engine: Any) -> None:
    url = data_url((200, 30, 30))
    full = ask(client, url, "What colour is it?")
    assert full.choices[0].message.content is not None and full.usage.completion_tokens > 0
    chunks = list(ask(client, url, "What colour is it?", stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    usage = [c.usage for c in chunks if c.usage is not None][-1]
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens >= full.usage.prompt_tokens - PAGE  # same prompt again
    wait_idle(engine)


def test_same_image_reused_different_image_not(client: openai.OpenAI, engine: Any) -> None:
    url_a, url_b = data_url((10, 120, 240)), data_url((240, 200, 10))
    first = ask(client, url_a, "Is there a person?")
    enc0 = engine.stats().get("image_encoder_runs")
    second = ask(client, url_a, "How many objects are there?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    text_only = client.chat.completions.create(
        model=SERVED, max_tokens=1, **greedy(),
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}])
    sys_len = text_only.usage.prompt_tokens - 8  # about where the user turn begins
    # the shared system prompt and the image's soft tokens: all but the question's pages reused
    assert cached >= first.usage.prompt_tokens - 2 * PAGE - 12, (cached, first.usage.prompt_tokens)
    assert engine.stats().get("image_encoder_runs") == enc0  # the image was not encoded again
    other = ask(client, url_b, "Is there a person?")
    assert other.usage.prompt_tokens_details.cached_tokens <= sys_len + PAGE  # only the text before it
    wait_idle(engine)


@pytest.mark.parametrize("url, phrase", [
    ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAA", "image"),  # truncated PNG
    ("data:text/plain;base64,aGVsbG8=", "image"),  # wrong MIME
    ("data:image/png;base64,@@@@", "base64"),
    ("https://example.com/cat.png", "--allowed-media-domains"),
    ("file:///etc/passwd", "--allowed-local-media-path"),
])
def test_bad_images_are_400s_naming_the_part(client: openai.OpenAI, url: str, phrase: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url, "What is it?")
    body = e.value.body
    assert "messages[1].content[0]" in (body.get("param") or ""), body
    assert phrase in body["message"], body


def test_decompression_bomb_header_is_refused_fast(client: openai.OpenAI) -> None:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url, "What is it?")
    assert "pixels" in e.value.body["message"]


def test_too_many_images(client: openai.OpenAI) -> None:
    parts = [{"type": "image_url", "image_url": {"url": data_url((i, i, i), (20, 20))}} for i in range(17)]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, max_tokens=1,
                                       messages=[{"role": "user", "content": parts}])
    assert "images" in e.value.body["message"]


def test_several_images_and_formats_in_one_conversation(client: openai.OpenAI, engine: Any) -> None:
    msgs = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url((1, 2, 3), fmt="JPEG")}},
                {"type": "image_url", "image_url": {"url": data_url((9, 9, 200), fmt="WEBP")}},
                {"type": "text", "text": "Compare them."}]},
            {"role": "assistant", "content": "The first is dark."},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url((0, 250, 0),
                                                                                            fmt="GIF")}},
                                         {"type": "text", "text": "And this one?"}]}]
    r = client.chat.completions.create(model=SERVED, max_tokens=4, messages=msgs, **greedy())
    assert r.usage.completion_tokens > 0
    wait_idle(engine)


def test_responses_input_image(client: openai.OpenAI) -> None:
    url = data_url((50, 60, 70))
    r = client.responses.create(model=SERVED, max_output_tokens=6, temperature=0.0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url, "detail": "low"},
                                     {"type": "input_text", "text": "Describe it."}]}])
    assert r.usage.input_tokens > 20 and r.output_text is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=SERVED, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}])
    assert "file_id" in e.value.body["message"]


def test_inspector_shows_image_spans(server: Any, client: openai.OpenAI) -> None:
    ask(client, data_url((77, 77, 1)), "What is it?")
    with server.http() as h:
        state = h.get("/v1/cache/state", params={"top": 64}).json()
    assert any("[image " in n["preview"] for n in state["nodes"]), [n["preview"] for n in state["nodes"]]


def test_tokenize_counts_image_tokens(server: Any, client: openai.OpenAI) -> None:
    url = data_url((5, 5, 250))
    r = ask(client, url, "Count?")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "Count?"}]}]
    with server.http() as h:
        t = h.post("/tokenize", json={"model": SERVED, "messages": messages}).json()
    assert t["count"] == r.usage.prompt_tokens


def test_image_in_a_tool_result(client: openai.OpenAI) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "Take a screenshot and describe it."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": [
                {"type": "text", "text": "screenshot taken"},
                {"type": "image_url", "image_url": {"url": data_url((120, 120, 120))}}]}]
    tools = [{"type": "function", "function": {"name": "screenshot", "parameters": {"type": "object"}}}]
    with_image = client.chat.completions.create(model=SERVED, max_tokens=2, messages=msgs, tools=tools)
    msgs[2]["content"] = "screenshot taken"
    text_only = client.chat.completions.create(model=SERVED, max_tokens=2, messages=msgs, tools=tools)
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens + 20  # the image's soft tokens
