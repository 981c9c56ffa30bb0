"""Host / Origin checks without an API key (server/http/admin_guard.py; issue 24 item 2 extends them from
the admin POSTs to every route that returns prompt text or runs inference): a DNS-rebinding Host is
refused with a 403 envelope on every route but /health and /metrics, a cross-site POST on every POST
route; loopback names, IP addresses, --host and --allowed-hosts are allowed; with a key the key decides.
The same in a real browser: tests/server/test_ui.py::test_rebinding_page_cannot_read_or_frame."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability.test_limits import assert_envelope

FLUSH = "/flush_cache"
USER = [{"role": "user", "content": "hi"}]
POSTS = [  # (path, body): each returns prompt text or runs inference, or changes server state
    ("/v1/completions", {"prompt": "a", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    ("/tokenize", {"prompt": "secret prompt"}),
    ("/detokenize", {"tokens": [5, 6]}),
    (FLUSH, None),
    ("/reset_prefix_cache", None),
]
GETS = ["/v1/cache/state", "/v1/models", "/v1/loads", "/openapi.json", "/", "/ui/app.js"]


@pytest.mark.parametrize("headers,status,code", [
    ({}, 200, None),  # curl / SDKs: Host 127.0.0.1:port, no Origin
    ({"host": "localhost:1919"}, 200, None),
    ({"host": "LocalHost.:1919"}, 200, None),
    ({"host": "[::1]:1919"}, 200, None),
    ({"host": "127.0.0.2"}, 200, None),
    ({"host": "10.1.2.3:1919"}, 200, None),  # an address: a rebinding page always has a name
    ({"host": "[fd00::5]:1919"}, 200, None),
    ({"origin": "http://localhost:5173"}, 200, None),  # a local page of this machine
    ({"host": "evil.example:1919"}, 403, "host_not_allowed"),  # DNS rebinding
    ({"host": "127.0.0.1.nip.io:1919"}, 403, "host_not_allowed"),
    ({"origin": "https://evil.example"}, 403, "cross_origin"),  # a cross-site form POST
    ({"origin": "null"}, 403, "cross_origin"),  # sandboxed iframe / file:// page
    ({"sec-fetch-site": "cross-site"}, 403, "cross_origin"),
    ({"origin": "http://127.0.0.1:1919", "sec-fetch-site": "cross-site"}, 403, "cross_origin"),
])
def test_posts_without_key(live: Any, headers: dict, status: int, code: str | None) -> None:
    s = live("--ui")
    with s.http() as h:
        for path, body in POSTS:
            r = h.post(path, json=body, headers=headers)
            if status == 200:
                assert r.status_code == 200, (path, r.text)
            else:
                assert assert_envelope(r, status)["code"] == code, path
        for path in ("/health", "/metrics"):  # open, as with a key
            assert h.get(path, headers=headers).status_code == 200, path


@pytest.mark.parametrize("headers,status", [
    ({}, 200),
    ({"host": "localhost"}, 200),
    ({"host": "192.168.7.9:80"}, 200),
    ({"origin": "https://evil.example"}, 200),  # a cross-origin GET: the browser does not let it read
    ({"host": "evil.example:1919"}, 403),
    ({"host": "evil.example", "origin": "http://evil.example"}, 403),
])
def test_reads_check_the_host(live: Any, headers: dict, status: int) -> None:
    s = live("--ui")
    with s.http() as h:
        for path in GETS:
            r = h.get(path, headers=headers)
            if status == 200:
                assert r.status_code == 200, (path, r.text[:200])
            else:
                assert assert_envelope(r, 403)["code"] == "host_not_allowed", path
        assert h.get("/health", headers=headers).status_code == 200


def test_allowed_hosts_and_origins_flags(live: Any) -> None:
    s = live("--allowed-hosts", "swa.lan", "--allowed-origins", "https://ui.example")
    with s.http() as h:
        assert h.post(FLUSH, headers={"host": "swa.lan:1919"}).status_code == 200
        assert h.post(FLUSH, headers={"host": "swa.lan", "origin": "http://swa.lan:1919"}).status_code == 200
        assert h.post(FLUSH, headers={"origin": "https://ui.example"}).status_code == 200
        assert h.get("/v1/cache/state", headers={"host": "SWA.lan."}).status_code == 200
        r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                   headers={"host": "swa.lan", "origin": "https://ui.example",
                            "sec-fetch-site": "cross-site"})
        assert r.status_code == 200, r.text  # an allowed CORS origin
        assert_envelope(h.post(FLUSH, headers={"host": "other.lan"}), 403)
        assert_envelope(h.get("/v1/cache/state", headers={"host": "other.lan"}), 403)
        assert_envelope(h.post(FLUSH, headers={"origin": "https://evil.example"}), 403)
    s2 = live("--allowed-hosts", "*")
    with s2.http() as h:
        assert h.post(FLUSH, headers={"host": "anything.example"}).status_code == 200
        assert h.get("/v1/cache/state", headers={"host": "anything.example"}).status_code == 200


def test_with_a_key_the_key_decides(live: Any) -> None:
    s = live("--api-key", "k3y")
    with s.http() as h:
        auth = {"authorization": "Bearer k3y"}
        assert h.post(FLUSH, headers={"host": "evil.example", **auth}).status_code == 200
        assert h.get("/v1/cache/state", headers={"host": "evil.example", **auth}).status_code == 200
        assert_envelope(h.post(FLUSH, headers={"origin": "https://evil.example"}), 401)


def test_bind_host_is_allowed(live: Any) -> None:
    from swaserve.server.launch import server_config_from_args
    from tests.reliability.conftest import serve_args

    assert "192.168.7.9" in server_config_from_args(serve_args("--host", "192.168.7.9")).allowed_hosts
    assert server_config_from_args(serve_args("--host", "0.0.0.0")).allowed_hosts == ()
    s = live("--host", "gpu-box.lan")  # the config only: the test server listens on 127.0.0.1
    with s.http() as h:
        assert h.get("/v1/models", headers={"host": "gpu-box.lan:1919"}).status_code == 200
        assert_envelope(h.get("/v1/models", headers={"host": "gpu-box2.lan:1919"}), 403)
