"""A bounded random fuzzer over the server's own OpenAPI document (schemathesis: valid and invalid bodies
per operation, drawn by hypothesis), against the real engine: no 5xx, every error an envelope, and the
engine idle with no page used afterwards. ~300 cases; the context is 64 tokens so that no generated
request runs long. Skips (with the reason) where schemathesis is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from swaserve.server.app import build_app
from swaserve.server.launch import server_config_from_args
from tests.server.conftest import LiveServer, make_engine, serve_args, wait_idle

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install "
                                   "'swaserve[test]')")
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = 100  # per operation and mode (hypothesis stops early where a schema has few distinct inputs)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[Any, LiveServer]]:
    eng = make_engine("--context-length", "64", "--max-running-requests", "4")
    s = LiveServer(build_app(eng, server_config_from_args(serve_args())))
    yield eng, s
    s.stop()
    eng.shutdown()


def test_schema_fuzz_no_5xx(fuzz_server: tuple[Any, LiveServer]) -> None:
    eng, s = fuzz_server
    with s.http() as h:
        doc = h.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(doc)
    seen: dict[int, int] = {}
    cases = 0
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                nonlocal cases
                r = case.call(base_url=s.url, timeout=60)
                cases += 1
                seen[r.status_code] = seen.get(r.status_code, 0) + 1
                assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
                if r.status_code >= 400 and r.status_code != 499:
                    err = r.json()["error"]
                    assert set(err) == {"message", "type", "param", "code"}, r.text[:300]

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (a GET without parameters)
                assert mode is GenerationMode.NEGATIVE
    print(f"{cases} cases, statuses {dict(sorted(seen.items()))}")
    assert cases >= 200 and seen.get(200, 0) > 0 and seen.get(400, 0) > 0
    wait_idle(eng)
