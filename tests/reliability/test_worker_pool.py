"""The chat worker processes over HTTP (issue 24 item 3, server/proc_pool.py): a killed busy worker fails
only its own request, killed idle workers cost the next requests nothing, a large body never holds every
worker (a small chat is not queued behind two), the render budget counts CPU time (a 2,000-message chat
renders beside CPU hogs), and a chat body whose content cannot fit the context is refused before
rendering. Two worker processes, as on a 2-core machine by default."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from swaserve.engine.text import template_sandbox
from swaserve.server import off_loop
from swaserve.server.chat import worker as chat_worker
from swaserve.server.prompt_limits import max_token_chars

# LOOP: runs until the render budget; SLOW: a few seconds of CPU, then the conversation
TEMPLATE = ("{% if messages[0].content == 'LOOP' %}{% for i in range(100000) %}{% for j in range(100000) %}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% if messages[0].content == 'SLOW' %}{% for i in range(1500) %}{% for j in range(10000) %}"
            "{% endfor %}{% endfor %}{% endif %}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>")
PAD = b" " * (chat_worker.LARGE_BODY_BYTES + 1)  # the same JSON, over the large-body threshold


@pytest.fixture(scope="module")
def two_workers() -> Iterator[None]:
    off_loop.configure_processes(2)
    yield
    off_loop.configure_processes(None)


def _serve(live: Any, tmp_path: Any, *flags: str) -> Any:
    tpl = tmp_path / "t.jinja"
    tpl.write_text(TEMPLATE)
    return live("--chat-template", str(tpl), *flags)


@pytest.fixture
def server(live: Any, two_workers: None, tmp_path: Any) -> Any:
    return _serve(live, tmp_path)


@pytest.fixture
def patient_server(live: Any, two_workers: None, tmp_path: Any) -> Any:
    """LOOP runs until killed: a budget passed to the workers as a flag (a monkeypatched module default
    does not reach worker processes started before it; a loaded box's set-up could outlast 10 CPU-s)."""
    return _serve(live, tmp_path, "--chat-template-timeout", "300")


def _chat(url: str, content: str, out: dict[str, Any], key: str, pad: bool = False) -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()
    t0 = time.perf_counter()
    with httpx.Client(base_url=url, timeout=600) as h:
        r = h.post("/v1/chat/completions", content=raw + (PAD if pad else b""),
                   headers={"content-type": "application/json"})
    out[key] = (r.status_code, r.json(), time.perf_counter() - t0)


def _start(url: str, content: str, out: dict[str, Any], key: str, pad: bool = False) -> threading.Thread:
    t = threading.Thread(target=_chat, args=(url, content, out, key, pad))
    t.start()
    return t


def _until(check: Any, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _warm(url: str) -> list[int]:
    out: dict[str, Any] = {}
    for t in [_start(url, "hi", out, f"w{i}") for i in range(2)]:
        t.join()
    assert all(v[0] == 200 for v in out.values()), out
    pids = off_loop.process_pool().pids()
    assert None not in pids
    return pids  # type: ignore[return-value]


def test_a_killed_busy_worker_fails_only_its_own_request(patient_server: Any) -> None:
    server = patient_server
    pool = off_loop.process_pool()
    _warm(server.url)
    out: dict[str, Any] = {}
    threads = [_start(server.url, "LOOP", out, "victim")]
    _until(lambda: pool.busy() == 1)
    [pid] = pool.running_pids()
    threads.append(_start(server.url, "SLOW", out, "running"))  # on the other worker
    _until(lambda: pool.busy() == 2)
    threads.append(_start(server.url, "hi", out, "waiting"))  # no worker free: it waits for one
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(600)
    status, body, _ = out["victim"]
    assert status == 500 and body["error"]["code"] == "worker_died", body
    assert out["running"][0] == 200 and out["waiting"][0] == 200, out
    assert pid not in pool.pids()


def test_killed_idle_workers_cost_the_next_requests_nothing(server: Any) -> None:
    pids = _warm(server.url)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    out: dict[str, Any] = {}
    for t in [_start(server.url, "hi", out, f"after{i}") for i in range(2)]:
        t.join(600)
    assert [v[0] for v in out.values()] == [200, 200], out
    assert not set(pids) & set(off_loop.process_pool().pids())


def test_a_small_chat_is_not_queued_behind_large_bodies(server: Any, monkeypatch: Any) -> None:
    """Two large bodies whose template runs 3 CPU-s each, then a small chat: the large ones take one
    worker at a time, so the small one finishes in a fraction of the first large one's time (with every
    worker theirs it waited as long as that one: a ratio of 1 or more, whatever the machine's load)."""
    monkeypatch.setattr(template_sandbox, "RENDER_TIME_LIMIT_S", 3.0)
    _warm(server.url)
    out: dict[str, Any] = {}
    threads = [_start(server.url, "LOOP", out, f"big{i}", pad=True) for i in range(2)]
    _until(lambda: off_loop.process_pool().busy() >= 1)
    time.sleep(0.3)
    threads.append(_start(server.url, "hi", out, "small"))
    for t in threads:
        t.join(600)
    for key in ("big0", "big1"):
        status, body, _ = out[key]
        assert status == 400 and body["error"]["code"] == "chat_template_error", body
    assert out["small"][0] == 200, out["small"]
    first_big = min(out["big0"][2], out["big1"][2])
    print(f"small chat {out['small'][2]:.2f} s beside large bodies of {out['big0'][2]:.2f} / "
          f"{out['big1'][2]:.2f} s")
    assert out["small"][2] < 0.5 * first_big, out


def test_a_chat_body_over_the_context_in_characters_is_refused_before_rendering(server: Any) -> None:
    """The issue's case: two 7.8 MB chat bodies and a small chat. Their content alone is more characters
    than the context can hold: a 400 from the character bound, not from rendering and tokenizing them."""
    engine = server.state.engine
    per = max_token_chars(engine.tokenizer)
    assert per is not None
    text = "the weather report for the next week\n" * (7_800_000 // 37)
    assert len(text) > engine.context_length * per
    out: dict[str, Any] = {}
    threads = [_start(server.url, text, out, f"big{i}") for i in range(2)]
    threads.append(_start(server.url, "hi", out, "small"))
    for t in threads:
        t.join(600)
    for key in ("big0", "big1"):
        status, body, _ = out[key]
        err = body["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", body
        chars = len(text.strip())  # content is counted stripped (a template may trim it)
        assert f"the prompt has at least {-(-chars // per)} tokens ({chars} characters" in err["message"]
    assert out["small"][0] == 200


@pytest.mark.slow  # a minute or more: the render beside the hogs
def test_the_render_budget_counts_cpu_time_not_wall_time(live: Any, two_workers: None,
                                                         monkeypatch: Any) -> None:
    """A 2,000-message chat (the demo model's template: ~2.4 CPU-s cold) to /tokenize, rendered in a
    worker process at nice +5 beside 2 CPU hogs per core, with a budget of 2.5x its CPU cost: it takes far
    longer than the budget in wall time, and renders."""
    s = live()
    template = s.state.chat_template()
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} on the weather"}
            for i in range(2000)]
    probe = [{**m, "content": "probe " + m["content"]} for m in msgs]  # not in any cache the render uses
    t0 = time.thread_time()
    template.render(probe)
    cost = time.thread_time() - t0
    budget = max(0.5, 2.5 * cost)
    monkeypatch.setattr(template_sandbox, "RENDER_TIME_LIMIT_S", budget)
    _warm(s.url)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * off_loop.usable_cores())]
    try:
        t0 = time.perf_counter()
        with httpx.Client(base_url=s.url, timeout=600) as h:
            r = h.post("/tokenize", json={"messages": msgs})
        wall = time.perf_counter() - t0
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    print(f"render CPU cost {cost:.2f} s, budget {budget:.2f} s, wall beside the hogs {wall:.2f} s")
    assert r.status_code == 200, r.text
    assert len(r.json()["message_starts"]) == 2000
    assert wall > budget, "the machine was not loaded enough for wall time to pass the budget"
