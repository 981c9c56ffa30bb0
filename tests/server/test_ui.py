"""The cache inspector against a live demo server: GET /v1/cache/state checked against the cache's own
integrity view and a from-scratch walk of the tree, the page's routes, --ui and --api-key, and the page
itself in headless Chromium (Debian's package, driven by Playwright with the system browser; skipped
with a reason where either is absent)."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from swaserve.server.app import build_app
from swaserve.server.launch import is_loopback, server_config_from_args
from tests.server.conftest import SERVED, LiveServer, make_engine, serve_args, wait_idle

SYSTEM = ("You are the support agent of a bicycle shop. Answer briefly and politely; the shop opens at nine, "
          "closes at six, repairs take two days, and every answer ends with a friendly greeting.")


@pytest.fixture(scope="module")
def ui_engine() -> Iterator[Any]:
    eng = make_engine("--max-total-tokens", "32768")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def ui_server(ui_engine: Any) -> Iterator[LiveServer]:
    s = LiveServer(build_app(ui_engine, server_config_from_args(serve_args("--served-model-name", SERVED,
                                                                            "--ui"))))
    yield s
    s.stop()


def chat(server: LiveServer, user: str) -> Any:
    return server.client().chat.completions.create(
        model=SERVED, max_tokens=4, temperature=0.0,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])


def prompt_ids(server: LiveServer, user: str) -> list[int]:
    with server.http() as h:
        r = h.post("/tokenize", json={"model": SERVED, "messages": [{"role": "system", "content": SYSTEM},
                                                                     {"role": "user", "content": user}]})
    return r.json()["tokens"]


def tree_by_path(cache: Any) -> dict[tuple[int, ...], Any]:
    out = {}
    stack = [(c, ()) for c in cache.root.children.values()]
    while stack:
        nd, prefix = stack.pop()
        path = prefix + tuple(nd.tokens)
        out[path] = nd
        stack.extend((c, path) for c in nd.children.values())
    return out


def subtree(nd: Any) -> tuple[int, int]:
    pages, nodes = len(nd.full_pages), 1
    for c in nd.children.values():
        a, b = subtree(c)
        pages, nodes = pages + a, nodes + b
    return pages, nodes


def test_state_agrees_with_the_integrity_view(ui_server, ui_engine):
    with ui_server.http() as h:
        assert h.post("/flush_cache").status_code == 200
    users = ["When do you open?", "How long does a repair take?", "Do you sell helmets?"]
    replies = [chat(ui_server, u) for u in users]
    wait_idle(ui_engine)
    with ui_server.http() as h:
        r = h.get("/v1/cache/state", params={"top": 512})
    assert r.status_code == 200, r.text
    st = r.json()
    assert st["object"] == "cache.state" and st["tree"] and st["consistent"]
    core = ui_engine.core
    with ui_engine._step_lock:  # the loop thread is idle: read the tree as it is
        core.cache.check_integrity(used_full=0, used_swa=0)  # from scratch: the counters below are exact
        cache = core.cache
        assert st["totals"] == {"nodes": len(cache._nodes), "full_pages": cache.full_cached,
                                "swa_live_pages": cache.swa_cached}
        assert st["counters"]["full_locked_pages"] == cache.full_locked == 0
        assert st["pools"]["full_pool"]["cached"] == cache.full_cached
        assert st["pools"]["swa_pool"]["cached"] == cache.swa_cached
        nodes = tree_by_path(cache)
        paths: dict[int, tuple[int, ...]] = {}
        assert len(st["nodes"]) == len(cache._nodes)
        for n in st["nodes"]:
            prefix = () if n["parent"] is None else paths[n["parent"]]
            start, end = len(prefix), len(prefix) + n["tokens"]
            nd = next(v for k, v in nodes.items() if len(k) == end and k[:start] == prefix
                      and list(k[start:start + len(n["preview_ids"])]) == n["preview_ids"])
            paths[n["id"]] = prefix + tuple(nd.tokens)
            assert n["start_token"] == len(prefix)
            assert (n["subtree_tokens"] // st["page_size"], n["subtree_nodes"]) == subtree(nd)
            assert n["swa_live_pages"] == sum(s is not None for s in nd.swa_pages)
            text = " ".join(ui_engine.tokenizer.decode(n["preview_ids"], skip_special_tokens=False).split())
            cut = n["preview"].endswith("\u2026") and text.startswith(n["preview"][:-1])
            assert n["preview"] == text or cut
    # the recent requests: the reused length the client saw and why reuse stopped
    page = st["page_size"]
    ids = [prompt_ids(ui_server, u) for u in users]
    recent = {r["request_id"]: r for r in st["recent_requests"]}
    first = recent[replies[0].id]
    assert first["cached_tokens"] == 0 and first["reason"] == "no_match"
    for reply, mine in zip(replies[1:], ids[1:]):
        rec = recent[reply.id]
        common = max(len(os.path.commonprefix([mine, other])) for other in ids[:ids.index(mine)])
        assert rec["prompt_tokens"] == len(mine) == reply.usage.prompt_tokens
        assert rec["matched_tokens"] == common
        assert rec["cached_tokens"] == common // page * page
        assert rec["reason"] == ("page_alignment" if common % page else "no_match")
    # the largest prefix first: the shared system prompt's node
    root = st["nodes"][0]
    assert root["parent"] is None and root["start_token"] == 0
    assert root["subtree_nodes"] >= 3 and root["tokens"] >= common // page * page - page


def test_state_is_bounded_and_checks_top(ui_server):
    chat(ui_server, "Is there parking?")
    with ui_server.http() as h:
        two = h.get("/v1/cache/state", params={"top": 2}).json()
        assert len(two["nodes"]) == 2
        assert sum(n["tokens"] for n in two["nodes"]) + two["hidden"]["tokens"] == \
            two["totals"]["full_pages"] * two["page_size"]
        for bad in (0, 513, "x"):
            r = h.get("/v1/cache/state", params={"top": bad})
            assert r.status_code in (400, 422) and "error" in r.json(), r.text
        assert len(two["recent_requests"]) <= 64 and len(two["pool_history"]) <= 600


def test_page_routes_and_flags(ui_server, ui_engine):
    with ui_server.http() as h:
        page = h.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/ui/app.js">' in page.text and "https://" not in page.text  # no CDN
        assert '<script src="/ui/chat_parts.js">' in page.text and 'id="images" type="file"' in page.text
        js = h.get("/ui/app.js")
        assert js.status_code == 200 and "javascript" in js.headers["content-type"] and "http" not in js.text
        parts = h.get("/ui/chat_parts.js")
        assert parts.status_code == 200 and "javascript" in parts.headers["content-type"]
        assert "function userMessage" in parts.text and "http" not in parts.text
        assert "userMessage(" in js.text and "chatMessages(" in js.text  # the page builds its messages there
        for r in (page, js, parts):  # no framing (clickjacking), only this server's script and connections
            assert r.headers["x-frame-options"] == "DENY"
            csp = r.headers["content-security-policy"]
            assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp
            assert "connect-src 'self'" in csp
        assert h.get("/ui/secret.txt").status_code == 404
    off = LiveServer(build_app(ui_engine, server_config_from_args(serve_args("--no-ui"))))
    keyed = LiveServer(build_app(ui_engine, server_config_from_args(serve_args("--ui", "--api-key", "k3y"))))
    try:
        with off.http() as h:
            r = h.get("/")
            assert r.status_code == 404 and r.json()["error"]["code"] == "ui_disabled"
            assert h.get("/v1/cache/state").status_code == 200  # the JSON endpoint is always there
        with keyed.http() as h:
            for path in ("/", "/ui/app.js", "/ui/chat_parts.js", "/v1/cache/state"):
                assert h.get(path).status_code == 401, path
                assert h.get(path, headers={"Authorization": "Bearer k3y"}).status_code == 200, path
            assert h.post("/flush_cache").status_code == 401
    finally:
        off.stop()
        keyed.stop()
    for host, flag, want in (("127.0.0.1", None, True), ("localhost", None, True), ("::1", None, True),
                             ("0.0.0.0", None, False), ("10.1.2.3", None, False), ("0.0.0.0", "--ui", True),
                             ("127.0.0.1", "--no-ui", False)):
        args = serve_args("--host", host, *([flag] if flag else []))
        assert server_config_from_args(args).ui is want, (host, flag)
    assert is_loopback("127.0.0.5") and not is_loopback("example.com")


# ---- the chat's messages with images, under node ---------------------------------------------------
NODE_SCRIPT = """
const p = require(process.argv[1]);
const turn1 = p.userMessage("What is this?", ["data:image/png;base64,AAA", "data:image/jpeg;base64,BBB"]);
const conv = [turn1, {role: "assistant", content: "A cat."}, p.userMessage("And its colour?", [])];
const files = [{type: "image/png"}, {type: "text/plain"}, {type: "image/webp"}];
console.log(JSON.stringify({turn1, only_image: p.userMessage("", ["data:image/gif;base64,CCC"]),
                            messages: p.chatMessages("Be brief.", conv), no_system: p.chatMessages("", conv),
                            images: p.imageFiles(files).length}));
"""


def test_chat_messages_built_under_node(ui_server):
    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on this machine")
    with ui_server.http() as h:  # the file the page runs, as the server sends it
        src = h.get("/ui/chat_parts.js").text
    assert src == (Path(__file__).parents[2] / "server" / "ui" / "chat_parts.js").read_text()
    js = Path(__file__).parents[2] / "server" / "ui" / "chat_parts.js"
    out = subprocess.run([node, "-e", NODE_SCRIPT, str(js)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    img = lambda u: {"type": "image_url", "image_url": {"url": u}}  # noqa: E731
    turn1 = {"role": "user", "content": [img("data:image/png;base64,AAA"), img("data:image/jpeg;base64,BBB"),
                                         {"type": "text", "text": "What is this?"}]}
    assert got["turn1"] == turn1
    assert got["only_image"] == {"role": "user", "content": [img("data:image/gif;base64,CCC")]}
    later = [turn1, {"role": "assistant", "content": "A cat."},
             {"role": "user", "content": "And its colour?"}]
    assert got["messages"] == [{"role": "system", "content": "Be brief."}, *later]  # the history keeps images
    assert got["no_system"] == later and got["images"] == 2


def test_page_messages_are_accepted_by_the_server(ui_server):
    """What the page sends (the node-built shape) is a valid image chat request here."""
    buf = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 30, 30)).save(buf, "PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is this?"}]
    r = ui_server.client().chat.completions.create(model=SERVED, max_tokens=2, temperature=0.0,
                                                   messages=[{"role": "user", "content": content}])
    with ui_server.http() as h:
        text_only = h.post("/tokenize", json={"model": SERVED, "messages": [
            {"role": "user", "content": "What is this?"}]}).json()["count"]
    assert r.usage.prompt_tokens > text_only  # the image's soft tokens


# ---- the page in headless Chromium --------------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


BROWSER_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-dev-shm-usage"]


def _playwright() -> tuple[str, Any]:
    browser_path = _chromium()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (Debian: apt-get install -y chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    return browser_path, sync_api


def test_page_in_headless_chromium(ui_server, ui_engine, tmp_path):
    browser_path, sync_api = _playwright()
    with ui_server.http() as h:
        assert h.post("/flush_cache").status_code == 200
    shot = tmp_path / "inspector.png"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True, args=BROWSER_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            refused: list[str] = []
            page.on("console", lambda m: "Content Security Policy" in m.text and refused.append(m.text))
            page.goto(ui_server.url + "/")
            page.wait_for_function("() => document.getElementById('model').textContent.length > 0")
            assert page.text_content("#model") == SERVED
            page.fill("#system", SYSTEM)
            page.fill("#maxtok", "4")
            metas = []
            for user in ["When do you open?", "Do you sell helmets?"]:  # fan-out: one system prompt
                page.click("#newchat")
                page.fill("#input", user)
                page.click("#send")
                page.wait_for_function("() => document.querySelector('#log .assistant .meta') && "
                                       "document.querySelector('#log .assistant .meta').dataset.prompt",
                                       timeout=120_000)
                metas.append(page.eval_on_selector(
                    "#log .assistant .meta", "e => [e.textContent, e.dataset.cached, e.dataset.prompt]"))
            page.screenshot(path=str(tmp_path / "inspector-chat.png"), full_page=True)
            text, cached, prompt = metas[1]
            wait_idle(ui_engine)
            st = ui_server.http().get("/v1/cache/state").json()
            second = st["recent_requests"][0]
            assert int(cached) == second["cached_tokens"] > 0, metas
            assert f"cached {cached}" in text and f"prompt {prompt}" in text and "TTFT" in text
            assert "reuse stopped" in text
            assert int(metas[0][1]) == 0
            # the Cache tab: the shared system-prompt node, the recent requests, the chart
            page.click("#tab-cache")
            page.wait_for_function("() => document.body.dataset.cacheLoaded === '1'", timeout=60_000)
            root = st["nodes"][0]
            assert root["start_token"] == 0 and root["subtree_nodes"] >= 3
            first_row = page.locator("#tree ul.tree > li > .node").first
            assert first_row.get_attribute("data-start") == "0"
            assert int(first_row.get_attribute("data-tokens")) == root["tokens"]
            assert root["preview"][:20] in first_row.text_content()
            assert page.locator("#recent tbody tr").count() >= 2
            assert page.locator(f"#recent tr[data-request='{second['request_id']}']").count() == 1
            page.screenshot(path=str(shot), full_page=True)
            # flush from the page: the tree empties
            page.click("#flush")
            page.wait_for_function("() => document.getElementById('tree').textContent"
                                   ".includes('cache is empty')", timeout=30_000)
            page.click("#tab-chat")
            _image_conversation(page, ui_server, ui_engine)
            assert not errors, errors
            assert not refused, refused  # the page works under its Content-Security-Policy
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    keep = os.environ.get("SWASERVE_TEST_ARTIFACTS")
    if keep:  # CI or a developer may collect the screenshot
        os.makedirs(keep, exist_ok=True)
        for name in ("inspector.png", "inspector-chat.png"):
            shutil.copy(tmp_path / name, os.path.join(keep, f"{int(time.time())}-{name}"))


def _png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), color).save(buf, "PNG")
    return buf.getvalue()


def _image_conversation(page: Any, server: LiveServer, engine: Any) -> None:
    """Attach an image with the file input, send, then a second text turn in the same conversation: the
    image shows as a thumbnail, its tokens are in the prompt, the second turn resends it (its prompt
    matches the whole first prompt, image included, in the cache). Then a file the server cannot decode:
    its 400 shows. Runs on an empty cache."""
    page.click("#newchat")
    page.set_input_files("#images", files=[{"name": "red.png", "mimeType": "image/png",
                                            "buffer": _png((220, 20, 20))}])
    page.wait_for_selector("#attached .thumb img")
    page.fill("#input", "What colour is this?")
    page.click("#send")
    turns = []
    for n in (1, 2):
        page.wait_for_function(f"() => document.querySelectorAll('#log .assistant .meta').length === {n} && "
                               f"document.querySelectorAll('#log .assistant .meta')[{n - 1}].dataset.prompt",
                               timeout=120_000)
        turns.append(page.eval_on_selector_all(
            "#log .assistant .meta", f"es => [es[{n - 1}].textContent, es[{n - 1}].dataset.cached, "
                                     f"es[{n - 1}].dataset.prompt]"))
        if n == 1:
            assert page.locator("#log .user .thumb img").count() == 1
            assert page.locator("#attached .thumb").count() == 0  # sent with this turn only
            page.fill("#input", "And the shape?")
            page.click("#send")
    wait_idle(engine)
    st = server.http().get("/v1/cache/state", params={"top": 512}).json()
    with engine._step_lock:  # the image's soft tokens (pad ids past the vocabulary) are in the cached prefix
        vocab = engine.tokenizer.vocab_size
        assert any(t >= vocab for path in tree_by_path(engine.core.cache) for t in path)
    first_prompt, second_prompt = int(turns[0][2]), int(turns[1][2])
    latest = st["recent_requests"][0]  # the second turn
    assert latest["prompt_tokens"] == second_prompt > first_prompt
    with server.http() as h:
        text_only = h.post("/tokenize", json={"model": SERVED, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "What colour is this?"}]})
    n_text = text_only.json()["count"]
    assert first_prompt > n_text  # the image's soft tokens are in the prompt
    # the image was sent again, the same: the match runs past where the image starts (at most n_text
    # tokens in; a missing or different image would stop it there) into its span
    assert latest["matched_tokens"] > n_text, (latest, turns, n_text)
    # a file that is not an image the server can decode: the server's 400 shows, the turn is not kept
    page.click("#newchat")
    page.set_input_files("#images", files=[{"name": "bad.png", "mimeType": "image/png",
                                            "buffer": b"not a png"}])
    page.wait_for_selector("#attached .thumb img", state="attached")
    page.fill("#input", "And this?")
    page.click("#send")
    page.wait_for_selector("#log .assistant .meta .error", timeout=60_000)
    assert "400" in page.text_content("#log .assistant .meta .error")
    assert page.locator("#attached .thumb").count() == 1  # kept for another try
    page.click("#newchat")


# Chromium's own Private / Local Network Access checks also stop this page (a non-secure page reaching a
# loopback address); they are off here: other browsers, older Chromium and a page served from the LAN
# have none, and the server must not depend on them
NO_PRIVATE_NETWORK_CHECKS = ("LocalNetworkAccessChecks,PrivateNetworkAccessRespectPreflightResults,"
                             "BlockInsecurePrivateNetworkRequests")
ATTACKER = """<!doctype html><title>evil</title>
<iframe id="ui" src="{victim}/"></iframe><iframe id="health" src="{victim}/health"></iframe>
<script>
window.framesLoaded = 0;
for (const f of document.querySelectorAll("iframe")) f.onload = () => window.framesLoaded++;
</script>"""


def test_rebinding_page_cannot_read_or_frame(ui_server):
    """A DNS-rebinding page: evil.test resolves to 127.0.0.1 (Chromium's --host-resolver-rules), so to the
    browser this server is the page's own origin and it could read every answer; the server refuses its
    Host (403, no cache state, no prompt text). The same page cannot frame the inspector either (the
    server's /health, sent without those headers, frames: the browser frames pages in this setup)."""
    browser_path, sync_api = _playwright()
    with ui_server.http() as h:  # a cached prompt: the state's node previews show its text
        r = h.post("/v1/completions", json={"prompt": "marmalade is the secret " * 8, "max_tokens": 1})
        assert r.status_code == 200, r.text
    port = ui_server.port
    evil = f"http://evil.test:{port}"
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, headless=True,
                                     args=[*BROWSER_FLAGS, "--host-resolver-rules=MAP evil.test 127.0.0.1",
                                           f"--disable-features={NO_PRIVATE_NETWORK_CHECKS}"])
        try:
            page = browser.new_page()
            read = """async () => { const r = await fetch('/v1/cache/state');
                                   return [r.status, await r.text()]; }"""
            page.goto(ui_server.url + "/")  # the inspector at its own address reads the state
            status, body = page.evaluate(read)
            assert status == 200 and "marmalade" in body
            # the attacker's page itself comes from the attacker (before the rebinding); everything it
            # fetches afterwards reaches this server under the name evil.test
            page.route(evil + "/", lambda route: route.fulfill(
                status=200, content_type="text/html", body=ATTACKER.format(victim=ui_server.url)))
            page.goto(evil + "/")
            status, body = page.evaluate(read)
            assert status == 403 and "host_not_allowed" in body and "marmalade" not in body, body
            status, body = page.evaluate("""async () => { const r = await fetch('/tokenize', {method: 'POST',
                body: JSON.stringify({prompt: 'x'})}); return [r.status, await r.text()]; }""")
            assert status == 403, body
            assert page.evaluate("async () => (await fetch('/health')).status") == 200  # stays open
            page.wait_for_function("() => window.framesLoaded === 2", timeout=30_000)
            frames = {f.name or f.url: f for f in page.frames}
            health = next(f for f in page.frames if f.url.endswith("/health"))
            assert '"status"' in health.content() or "ok" in health.content().lower(), frames
            ui = [f for f in page.frames if f.url.rstrip("/") == ui_server.url]
            assert not ui or ui[0].evaluate("document.getElementById('model')") is None, frames
            assert any(f.url.startswith("chrome-error://") for f in page.frames), list(frames)
        finally:
            browser.close()
