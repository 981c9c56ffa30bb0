"""bench/cache_units.py: the KV bytes it counts are the engine's for gemma-4-26B-A4B, a pool's GiB and total
windows, and --kv-cache-memory-gb sizes through the command line."""

from __future__ import annotations

import json

import pytest

from swaserve.bench.cache_sim import Geometry, main, pool_pages, running_pages
from swaserve.bench.cache_units import KV_BYTES_PER_TOKEN, describe, pages_for_memory, pool_bytes


def test_bytes_per_token_are_the_engines() -> None:
    from swaserve.engine.attention.kv_format import KV_TYPES, KVFormat
    from swaserve.engine.attention.kv_pool import bytes_per_token
    from swaserve.models.demo.tiny import preset_config

    cfg = preset_config("26b-a4b")
    for name, got in KV_BYTES_PER_TOKEN.items():
        assert bytes_per_token(cfg, KVFormat(KV_TYPES[name], KV_TYPES[name])) == got


def test_units_of_a_pool() -> None:
    geo = Geometry()
    full, swa = pool_pages([], 8, geo)  # 8 windows of cache besides the running request's
    u = describe(full, swa, 16, 1024)
    assert u["total_windows"] == round(swa * 16 / 1024, 2) and swa == 8 * 64 + running_pages(geo)
    assert u["gib_bf16"] == round(16 * (full * 20480 + swa * 204800) / 2**30, 3)
    assert abs(u["gib_q8_0"] / u["gib_bf16"] - 1.0625 / 2) < 1e-3
    # a memory size in GiB gives pools of that many bytes (to a page), in either type
    for t in KV_BYTES_PER_TOKEN:
        f, s = pages_for_memory(4.0, 16, 4, t)
        assert f == 4 * s and 0 <= 4 * 2**30 - pool_bytes(f, s, 16, t) < pool_bytes(4, 1, 16, t)
    assert pages_for_memory(4.0, 16, 4, "q8_0")[1] > 1.8 * pages_for_memory(4.0, 16, 4, "bf16")[1]


def test_command_line_memory_sizes(capsys) -> None:
    assert main(["--json", "--workload", "multiturn", "--windows", "8", "--kv-cache-memory-gb", "4",
                 "--kv-cache-dtype", "q8_0", "--policy", "lazy"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()][1:]
    assert [r["swa_pool_windows"] for r in rows] == [8, "4GiB"]
    assert abs(rows[1]["gib_q8_0"] - 4.0) < 0.01 and rows[1]["total_windows"] > 14
    assert main(["--workload", "multiturn", "--windows", "4", "--policy", "lazy,lazy-no-msg-anchors"]) == 0
    out = capsys.readouterr().out
    assert "GiB bf16" in out and "lazy-no-msg-anchors" in out


def test_command_line_memory_errors(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--kv-cache-memory-gb", "x"])
    assert e.value.code == 2 and "--kv-cache-memory-gb: expected positive numbers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="cannot hold"):
        main(["--workload", "multiturn", "--windows", "4", "--kv-cache-memory-gb", "0.1", "--policy", "lazy"])
