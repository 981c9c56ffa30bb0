"""Host / Origin checks on the admin routes without an API key (server/http/admin_guard.py): a cross-site POST
and a DNS-rebinding Host are refused with a 403 envelope; loopback names, --host and --allowed-hosts are
allowed; with a key the key decides; inference routes are not affected."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability.test_limits import assert_envelope

FLUSH = "/flush_cache"


@pytest.mark.parametrize("headers,status,code", [
    ({}, 200, None),  # curl / SDKs: Host 127.0.0.1:port, no Origin
    ({"host": "localhost:1919"}, 200, None),
    ({"host": "[::1]:1919"}, 200, None),
    ({"host": "127.0.0.2"}, 200, None),
    ({"origin": "http://localhost:5173"}, 200, None),  # a local page of this machine
    ({"host": "evil.example:1919"}, 403, "host_not_allowed"),  # DNS rebinding
    ({"origin": "https://evil.example"}, 403, "cross_origin"),  # a cross-site form POST
    ({"origin": "null"}, 403, "cross_origin"),  # sandboxed iframe / file:// page
    ({"sec-fetch-site": "cross-site"}, 403, "cross_origin"),
    ({"origin": "http://127.0.0.1:1919", "sec-fetch-site": "cross-site"}, 403, "cross_origin"),
])
def test_admin_post_without_key(live: Any, headers: dict, status: int, code: str | None) -> None:
    s = live()
    with s.http() as h:
        for path in (FLUSH, "/reset_prefix_cache"):
            r = h.post(path, headers=headers)
            if status == 200:
                assert r.status_code == 200, r.text
            else:
                assert assert_envelope(r, status)["code"] == code
        # inference and reads are not guarded
        r = h.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=headers)
        assert r.status_code == 200, r.text


def test_allowed_hosts_and_origins_flags(live: Any) -> None:
    s = live("--allowed-hosts", "swa.lan", "--allowed-origins", "https://ui.example")
    with s.http() as h:
        assert h.post(FLUSH, headers={"host": "swa.lan:1919"}).status_code == 200
        assert h.post(FLUSH, headers={"host": "swa.lan", "origin": "http://swa.lan:1919"}).status_code == 200
        assert h.post(FLUSH, headers={"origin": "https://ui.example"}).status_code == 200
        assert_envelope(h.post(FLUSH, headers={"host": "other.lan"}), 403)
        assert_envelope(h.post(FLUSH, headers={"origin": "https://evil.example"}), 403)
    s2 = live("--allowed-hosts", "*")
    with s2.http() as h:
        assert h.post(FLUSH, headers={"host": "anything.example"}).status_code == 200


def test_with_a_key_the_key_decides(live: Any) -> None:
    s = live("--api-key", "k3y")
    with s.http() as h:
        auth = {"authorization": "Bearer k3y"}
        assert h.post(FLUSH, headers={"host": "evil.example", **auth}).status_code == 200
        assert_envelope(h.post(FLUSH, headers={"origin": "https://evil.example"}), 401)


def test_bind_host_is_allowed() -> None:
    from swaserve.server.launch import server_config_from_args
    from tests.reliability.conftest import serve_args

    assert "192.168.7.9" in server_config_from_args(serve_args("--host", "192.168.7.9")).allowed_hosts
    assert server_config_from_args(serve_args("--host", "0.0.0.0")).allowed_hosts == ()
