"""The benchmark end to end against fake servers (tests/bench/fake_server.py) over real HTTP."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from swaserve.bench import serve_bench
from swaserve.bench.serve_compare import ServerProcess, outputs_identical, parse_config
from swaserve.bench.serve_runner import BenchRunner
from swaserve.bench.serve_stats import RequestResult


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve_bench.add_bench_args(p)
    return p.parse_args(list(argv))


SMALL = (
    "--workload",
    "fanout,sweep,append",
    "--num-groups",
    "2",
    "--prompts-per-group",
    "3",
    "--system-prompt-len",
    "400",
    "--question-len",
    "20",
    "--output-len",
    "4",
    "--sweep-n",
    "3,8,64",
    "--sweep-prefix-len",
    "300",
    "--sweep-output-len",
    "2",
    "--num-sessions",
    "1",
    "--num-turns",
    "2",
)


def test_compare_against_fake_servers(fake_servers, capsys, tmp_path):
    args = _args(*SMALL, "--max-concurrency", "1")
    bench = BenchRunner(args, serve_bench._validate(args))
    for name in ("lazy", "eager", "naive"):
        bench.run_against(name if name != "eager" else "eager16", fake_servers[name].url, [])
    comps = {c["workload"]: c for c in bench.compare()}
    out = capsys.readouterr().out
    assert bench.tpw == (1.0, 1.0)  # the fake /tokenize counts words

    fan = comps["fanout"]
    assert fan["outputs_identical"] and fan["requests_compared"] == 6
    assert fan["ttft_focus_vs_naive"]["lazy"] < 0.5 and fan["ttft_focus_vs_naive"]["naive"] == 1.0
    assert fan["eager16_ttft_over_this"]["lazy"] > 2.0
    fan_runs = {r["config"]: r["summary"] for r in bench.runs if r["workload"] == "fanout"}
    assert fan_runs["lazy"]["cached_ratio_by_tag"]["non-first"] > 0.8
    assert fan_runs["eager16"]["cached_ratio_by_tag"]["non-first"] == 0.0
    assert fan_runs["naive"]["cached_tokens"] == 0

    verdicts = {c: {r["n"]: r["verdict"] for r in rows} for c, rows in comps["sweep"]["sweep"].items()}
    assert verdicts["lazy"] == {3: "REUSED", 8: "REUSED", 64: "REUSED"}
    assert verdicts["eager16"] == {3: "REUSED", 8: "REUSED", 64: "NO REUSE"}  # fake eager: gap 16
    assert comps["sweep"]["sweep"]["lazy"][0]["diverges"] == 3 + 5  # differing word, N, </turn>, 3 gen-prompt
    assert verdicts["naive"] == {3: "NO REUSE", 8: "NO REUSE", 64: "NO REUSE"}
    assert comps["append"]["outputs_identical"]
    app_runs = {r["config"]: r["summary"] for r in bench.runs if r["workload"] == "append"}
    assert app_runs["lazy"]["cached_ratio_by_tag"]["follow-up"] > 0.8

    assert "outputs identical across configurations (greedy): YES" in out
    assert "N=  64 -> 2nd cached      0 of" in out
    assert "TTFT [non-first] / naive" in out

    path = tmp_path / "b.json"
    bench.dump(str(path), list(comps.values()))
    doc = json.loads(path.read_text())
    assert len(doc["runs"]) == 9 and doc["runs"][0]["requests"][0]["prompt_tokens"] > 0
    assert {c["workload"] for c in doc["comparisons"]} == {"fanout", "sweep", "append"}


def test_run_bench_url_mode(fake_servers, tmp_path, capsys):
    path = tmp_path / "r.json"
    received = fake_servers["lazy"].app.state.received
    before = len(received)
    args = _args(
        "--url",
        fake_servers["lazy"].url,
        "--workload",
        "random",
        "--num-prompts",
        "6",
        "--random-input-len",
        "30",
        "--random-output-len",
        "3",
        "--request-rate",
        "200",
        "--json",
        str(path),
    )
    assert serve_bench.run_bench(args) == 0
    doc = json.loads(path.read_text())
    s = doc["runs"][0]["summary"]
    assert s["completed"] == 6 and s["completion_tokens"] == 18
    sent = received[before:]
    assert len(sent) == 7 and sent[0]["messages"][0]["content"].startswith("Warmup 0.")  # warmup not measured
    assert all(not b["messages"][0]["content"].startswith("Warmup") for b in sent[1:])
    assert "== random [server] 6 requests ==" in capsys.readouterr().out


def test_interleaved_runs_each_session_on_every_server(fake_servers):
    args = _args("--workload", "fanout,append", *SMALL[2:8], "--num-sessions", "2", "--num-turns", "2")
    bench = BenchRunner(args, serve_bench._validate(args))
    servers = [("lazy", fake_servers["lazy"].url, []), ("naive", fake_servers["naive"].url, [])]
    recv = {n: fake_servers[n].app.state.received for n in ("lazy", "naive")}
    before = {n: len(r) for n, r in recv.items()}
    bench.run_interleaved(servers)
    comps = {c["workload"]: c for c in bench.compare()}
    assert comps["fanout"]["outputs_identical"] and comps["append"]["outputs_identical"]
    assert comps["fanout"]["ttft_focus_vs_naive"]["lazy"] < 0.5
    sent = {n: [b["messages"][-1]["content"] for b in r[before[n] :]] for n, r in recv.items()}
    assert sent["lazy"] == sent["naive"] and len(sent["lazy"]) == 1 + 6 + 4  # warmup, fanout, 2 x 2 turns
    runs = [(r["config"], r["workload"]) for r in bench.runs]
    assert runs == [("lazy", "fanout"), ("naive", "fanout"), ("lazy", "append"), ("naive", "append")]
    assert all(0 < r["summary"]["duration_s"] for r in bench.runs)


def test_failed_requests_give_nonzero_exit(fake_servers):
    args = _args(
        "--url",
        fake_servers["lazy"].url,
        "--workload",
        "random",
        "--num-prompts",
        "2",
        "--random-input-len",
        "5",
        "--random-output-len",
        "2000",
    )  # the fake rejects > 1000
    assert serve_bench.run_bench(args) == 1


@pytest.mark.parametrize(
    "argv",
    [
        ("--workload", "nope"),
        ("--url", "http://x", "--compare"),
        ("--url", "http://x", "--model", "m.gguf"),
        ("--max-concurrency", "0"),
        ("--compare", "--temperature", "0.5"),
        ("--interleave", "--max-concurrency", "4"),
        ("--interleave", "--url", "http://x"),
        ("--config", "a=", "--config", "a=--page-size 4"),
    ],
)
def test_bad_flags(argv):
    with pytest.raises(ValueError):
        serve_bench.run_bench(_args(*argv))


def test_parse_config():
    assert parse_config("eager64=--swa-retain-policy eager --swa-retain-budget 64") == (
        "eager64",
        ["--swa-retain-policy", "eager", "--swa-retain-budget", "64"],
    )
    assert parse_config("plain=") == ("plain", [])
    with pytest.raises(ValueError):
        parse_config("noequals")


def test_outputs_identical():
    def r(key, text, ok=True):
        return RequestResult(key, 0, "t", ok=ok, text=text)

    assert outputs_identical({"a": [r("x", "1")], "b": [r("x", "1")]})[:2] == (True, 1)
    same, n, bad = outputs_identical({"a": [r("x", "1"), r("y", "2")], "b": [r("x", "1"), r("y", "3")]})
    assert not same and n == 2 and bad[0].startswith("y turn 0")
    assert not outputs_identical({"a": [r("x", "1")], "b": [r("x", "1", ok=False)]})[0]
    assert not outputs_identical({"a": [r("x", "1")], "b": []})[0]


class _FakeProcess(ServerProcess):
    @property
    def cmd(self) -> list[str]:
        return [sys.executable, "-m", "tests.bench.fake_server", "--port", str(self.port), *self.argv]


def test_server_process_starts_waits_and_stops(tmp_path):
    import httpx

    with _FakeProcess("lazy", ["--policy", "naive"], 60, str(tmp_path)) as srv:
        assert httpx.get(f"{srv.url}/v1/models").json()["data"][0]["id"] == "fake-naive"
        proc = srv.proc
    assert proc.poll() is not None  # stopped on exit


def test_run_bench_compare_starts_a_server_per_configuration(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(ServerProcess, "cmd", _FakeProcess.cmd)
    path = tmp_path / "c.json"
    args = _args(
        "--workload", "fanout", *SMALL[2:12], "--compare", "--server-args", "--page-size 4",
        "--server-log-dir", str(tmp_path), "--json", str(path),
    )  # fmt: skip
    assert serve_bench.run_bench(args) == 0
    out = capsys.readouterr().out
    assert "== fanout: comparison" in out and "outputs identical across configurations (greedy): YES" in out
    doc = json.loads(path.read_text())
    assert [r["config"] for r in doc["runs"]] == ["lazy", "eager16", "naive"]
    assert doc["runs"][1]["server_args"] == [
        "--page-size",
        "4",
        "--swa-retain-policy",
        "eager",
        "--swa-retain-budget",
        "16",
    ]
    (comp,) = doc["comparisons"]
    assert comp["ttft_focus_vs_naive"]["lazy"] < 0.5 and comp["outputs_identical"]
    assert sorted(p.name for p in tmp_path.glob("server-*.log")) == [
        "server-eager16.log",
        "server-lazy.log",
        "server-naive.log",
    ]


def test_server_process_that_dies_reports_its_log(tmp_path):
    srv = _FakeProcess("broken", ["--port"], 30, str(tmp_path))  # duplicate --port without a value
    with pytest.raises(RuntimeError, match="exited before becoming healthy"):
        with srv:
            pass


def test_plots_against_fake_servers(fake_servers, tmp_path):
    """--plot: the three charts as PNGs, and the series drawn in them taken from the run's records."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pip install 'swaserve[plot]')")
    from swaserve.bench import serve_plot

    args = _args(*SMALL, "--max-concurrency", "1", "--plot", str(tmp_path / "plots"))
    bench = BenchRunner(args, serve_bench._validate(args))
    for name in ("lazy", "naive"):
        bench.run_against(name, fake_servers[name].url, [])
    paths = serve_plot.write_plots(bench.runs, bench.divergence, args.plot)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["ttft.png", "sweep.png", "cached-share.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    series, prompts = serve_plot.sweep_series(bench.runs, bench.divergence)
    assert series["lazy"][0] == [3, 8, 64] and all(c > 0 for c in series["lazy"][1])
    assert series["naive"][1] == [0, 0, 0]
    assert sorted(prompts) == [3, 8, 64] and prompts[64] > prompts[3]  # longer tails, longer prompts
    tags, ttft = serve_plot.ttft_series(bench.runs, "fanout")
    assert tags == ["first", "non-first"] and set(ttft) == {"lazy", "naive"}
    lazy_med = ttft["lazy"][0][tags.index("non-first")]
    naive_med = ttft["naive"][0][tags.index("non-first")]
    assert 0 < lazy_med < naive_med  # the fake lazy server is faster on what it reuses
    share = serve_plot.cached_share_series(bench.runs, "fanout")
    xs, ys = share["naive"]
    assert xs == sorted(xs) and xs[0] == 0 and set(ys) == {0.0}
    assert max(share["lazy"][1]) > 0.5
    fanout = next(r for r in bench.runs if r["config"] == "lazy" and r["workload"] == "fanout")
    assert len(share["lazy"][0]) == len(fanout["results"])


def test_plot_flag_is_checked_up_front(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    args = _args("--plot", str(f))
    with pytest.raises(ValueError, match="not a directory"):
        serve_bench._validate(args)
