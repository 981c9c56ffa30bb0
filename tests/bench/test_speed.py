"""`swaserve bench speed`: the swaserve worker end to end on the demo model, the tables, the peer check,
the long-context and gap runs, the peer script's flags and flash-attention setter (no llama_cpp)."""

from __future__ import annotations

import argparse
import ctypes
import json
import types

import pytest

from swaserve.bench import speed_peer
from swaserve.bench.speed import (
    add_speed_args,
    clamp_contexts,
    format_gap,
    format_grid,
    format_table,
    model_context_length,
    parse_ints,
    peer_available,
    run_speed,
)
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
                 "--json", str(out_json), "--peer", "--peer-python", "/nonexistent/python", "--kv-gb", "0.05",
                 "--contexts", "96,160", "--context-gen", "4", "--gap-context", "160")
    assert run_speed(args) == 0
    out = capsys.readouterr()
    assert "llama.cpp skipped" in out.err  # the peer is optional: a clear line, then swaserve alone
    assert "| decode tok/s, 3 streams (aggregate) |" in out.out
    assert "| 1 | 1 | 160 |" in out.out and "| 1 | 3 | 6 each | - |" in out.out  # the combined table
    assert "| 1 | swaserve native | 160 |" in out.out  # the gap table
    got = json.loads(out_json.read_text())
    assert got["contexts"] == [96, 160] and got["gap_context"] == 160
    res = got["results"]["1"]["swaserve native"]
    assert res["prefill_tps_at_160"] > 0 and res["decode_tps_at_96_cpu"] > 0
    assert res["prefill_tps"] > 0 and res["decode_tps_1"] > 0 and res["decode_tps_3"] > 0
    assert res["ttft_first_s"] > 0 and res["rss_mb"] > 0


def test_peer_check_and_missing_file(capsys) -> None:
    assert peer_available("/nonexistent/python")
    assert run_speed(_args("--gguf", "/nonexistent.gguf")) == 2
    assert "no such file" in capsys.readouterr().err


def test_threads_and_lists_parse() -> None:
    assert parse_ints("1,2", "--threads") == [1, 2] and parse_ints("4", "--threads") == [4]
    assert parse_ints("", "--contexts") == []
    with pytest.raises(ValueError, match="--threads"):
        parse_ints("1,x", "--threads")
    with pytest.raises(ValueError, match=">= 1"):
        parse_ints("0", "--threads")
    assert _args("--gguf", "f", "--threads", "3").threads == "3"  # a single count still works
    assert run_speed(_args("--gguf", str(demo_model_path()), "--threads", "two")) == 2


def test_contexts_clamped_to_the_context_length(capsys) -> None:
    assert clamp_contexts([96, 40000, 50000], 16, 32768) == [96, 32752]  # duplicates after the cut dropped
    assert "context 40000 clamped to 32752" in capsys.readouterr().err
    assert clamp_contexts([40000], 16, None) == [40000]
    assert model_context_length(demo_model_path()) == 32768


def test_the_gap_run_needs_each_request_to_fit_not_their_sum() -> None:
    from swaserve.bench.speed_worker import longest_request, longest_run

    args = speed_peer.parse(["--gguf", "f", "--threads", "1", "--prompt-len", "128", "--gen", "4",
                             "--stream-prompt-len", "8", "--stream-gen", "2", "--contexts", "4096",
                             "--gap-context", "32767"])
    assert longest_request(args) == 32768  # fits a 32768-token model: the long prompt and one token
    assert longest_run(args) > 32768  # the KV pools hold both requests of the gap run


def _grid_args(**kw: str) -> argparse.Namespace:
    return _args("--gguf", "f", "--prompt-len", "12", "--streams", "8", "--stream-prompt-len", "6",
                 "--contexts", "4096", *[x for k, v in kw.items() for x in (f"--{k}", v)])


def test_format_grid_rows_and_best_peer_ratio() -> None:
    peer_on = {"prefill_tps": 100.0, "decode_tps_1": 10.0, "decode_tps_8": 40.0, "prefill_tps_at_4096": 50.0,
               "decode_tps_at_4096": 8.0, "prefill_tps_at_4096_cpu": 25.0}
    peer_off = dict(peer_on, prefill_tps_at_4096=40.0, decode_tps_at_4096=9.0)
    ours = {"prefill_tps": 50.0, "decode_tps_1": 5.0, "decode_tps_8": 60.0, "prefill_tps_at_4096": 100.0,
            "decode_tps_at_4096": 4.5, "prefill_tps_at_4096_cpu": 50.0}
    by_threads = {1: {"llama.cpp fa=on": peer_on, "llama.cpp fa=off": peer_off, "swaserve native": ours},
                  2: {"swaserve native": ours}}
    table = format_grid(by_threads, _grid_args())
    assert "| threads | streams | context | llama.cpp fa=on prefill |" in table
    assert "swaserve native / best llama.cpp, decode |" in table
    assert "| 1 | 1 | 12 | 100.0 | 10.0 | 100.0 | 10.0 | 50.0 | 5.0 | 0.50x | 0.50x |" in table
    assert "| 1 | 8 | 6 each | - | 40.0 | - | 40.0 | - | 60.0 | - | 1.50x |" in table
    assert "| 1 | 1 | 4096 | 50.0 | 8.0 | 40.0 | 9.0 | 100.0 | 4.5 | 2.00x | 0.50x |" in table  # best of fa
    assert "| 2 | 1 | 4096 | - | - | - | - | 100.0 | 4.5 | - | - |" in table
    cpu = format_grid(by_threads, _grid_args(), cpu=True)
    assert "| 1 | 1 | 4096 | 25.0 | - | 25.0 | - | 50.0 | - | 2.00x | - |" in cpu
    gap = {"context": 4096, "a_step_ms": 10.0, "gap_median_ms": 12.0, "gap_max_ms": 300.0, "b_ttft_s": 1.5}
    gaps = format_gap({1: {"swaserve native": {"gap": gap}}})
    assert "| 1 | swaserve native | 4096 | 10.0 | 12.0 | 300.0 | 1.50 |" in gaps


def test_gap_stats() -> None:
    # a decodes every 10 ms; the prompt arrives at 50 ms; two steps of 100 ms carry its chunks, a goes on
    a_times = [0.01, 0.02, 0.03, 0.04, 0.05, 0.15, 0.25, 0.26]
    g = speed_peer.gap_stats(a_times, b_added=0.05, b_first=0.25)
    assert g["a_step_ms"] == pytest.approx(10.0) and g["gaps_ms"] == pytest.approx([100.0, 100.0])
    assert g["gap_max_ms"] == pytest.approx(100.0) and g["b_ttft_s"] == pytest.approx(0.2)


def test_worker_long_contexts_and_gap_in_process() -> None:
    from swaserve.bench.speed_worker import Swa

    args = speed_peer.parse(["--gguf", str(demo_model_path()), "--threads", "1", "--prompt-len", "8",
                             "--gen", "3", "--stream-prompt-len", "4", "--stream-gen", "2", "--kv-gb", "0.05",
                             "--contexts", "96,160", "--context-gen", "3", "--gap-context", "160"])
    args.cpu_matmul, args.follow_load = "native", False
    engine = Swa(args, 2)
    try:
        res = speed_peer.measure(engine, args)
    finally:
        engine.llm.close()
    for c in (96, 160):
        assert res[f"prefill_tps_at_{c}"] > 0 and res[f"decode_tps_at_{c}"] > 0
        assert res[f"prefill_tps_at_{c}_cpu"] > 0 and res[f"decode_tps_at_{c}_cpu"] > 0
    g = res["gap"]
    assert g["context"] == 160 and g["gap_max_ms"] >= g["gap_median_ms"] > 0 and g["b_ttft_s"] > 0
    assert g["a_step_ms"] > 0 and len(g["gaps_ms"]) >= 1


def test_peer_parse_and_n_ctx() -> None:
    args = speed_peer.parse(["--gguf", "f", "--threads", "2", "--prompt-len", "128", "--gen", "32",
                             "--stream-prompt-len", "32", "--stream-gen", "16", "--contexts", "4096,32768",
                             "--context-gen", "16", "--gap-context", "32768", "--flash-attn", "off",
                             "--n-batch", "2048"])
    assert (args.flash_attn, args.n_batch, args.gap_context) == ("off", 2048, 32768)
    assert speed_peer.ints(args.contexts) == [4096, 32768]
    assert speed_peer.peer_n_ctx(args) >= 32768 + 128 + speed_peer.GAP_LEAD + 32768 // 2047
    with pytest.raises(SystemExit):
        speed_peer.parse(["--gguf", "f", "--threads", "1", "--prompt-len", "1", "--gen", "1",
                          "--stream-prompt-len", "1", "--stream-gen", "1", "--flash-attn", "maybe"])


def test_peer_flash_attn_setter() -> None:
    new = types.SimpleNamespace(flash_attn_type=-1)  # llama-cpp-python 0.3.x: the enum
    speed_peer.set_flash_attn(new, True)
    assert new.flash_attn_type == 1
    speed_peer.set_flash_attn(new, False)
    assert new.flash_attn_type == 0

    class Old(ctypes.Structure):  # older versions: a bool field of the ctypes struct
        _fields_ = [("n_ctx", ctypes.c_uint32), ("flash_attn", ctypes.c_bool)]

    old = Old()
    speed_peer.set_flash_attn(old, True)
    assert old.flash_attn is True
    with pytest.raises(SystemExit, match="flash_attn"):
        speed_peer.set_flash_attn(types.SimpleNamespace(), True)
