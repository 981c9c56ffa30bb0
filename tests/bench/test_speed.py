"""`swaserve bench speed`: the swaserve worker end to end on the demo model, the table, the peer check."""

from __future__ import annotations

import argparse

import pytest

from swaserve.bench.speed import add_speed_args, format_table, peer_available, run_speed
from swaserve.models.demo.tiny import demo_model_path


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_speed_args(p)
    return p.parse_args(list(argv))


def test_format_table_ratios() -> None:
    res = {"llama.cpp": {"load_s": 2.0, "decode_tps_1": 10.0, "decode_tps_8": 40.0},
           "swaserve native": {"load_s": 1.0, "decode_tps_1": 5.0, "decode_tps_8": 60.0}}
    table = format_table(res, [8])
    assert "| decode tok/s, 1 stream | 10.00 | 5.00 | 0.50x |" in table
    assert "| decode tok/s, 8 streams (aggregate) | 40.00 | 60.00 | 1.50x |" in table
    assert "| warm TTFT s | - | - | - |" in table  # missing values stay visible


@pytest.mark.slow
def test_speed_runs_swaserve_on_the_demo_model(capsys, tmp_path) -> None:
    out_json = tmp_path / "speed.json"
    args = _args("--gguf", str(demo_model_path()), "--threads", "1", "--prompt-len", "12", "--gen", "4",
                 "--streams", "3", "--stream-prompt-len", "6", "--stream-gen", "3", "--timeout", "600",
                 "--json", str(out_json), "--peer", "--peer-python", "/nonexistent/python", "--kv-gb", "0.05")
    assert run_speed(args) == 0
    out = capsys.readouterr()
    assert "llama.cpp skipped" in out.err  # the peer is optional: a clear line, then swaserve alone
    assert "| decode tok/s, 3 streams (aggregate) |" in out.out
    import json

    res = json.loads(out_json.read_text())["swaserve native"]
    assert res["prefill_tps"] > 0 and res["decode_tps_1"] > 0 and res["decode_tps_3"] > 0
    assert res["ttft_first_s"] > 0 and res["rss_mb"] > 0


def test_peer_check_and_missing_file(capsys) -> None:
    assert peer_available("/nonexistent/python")
    assert run_speed(_args("--gguf", "/nonexistent.gguf")) == 2
    assert "no such file" in capsys.readouterr().err
