"""Serving benchmark (issue 7) — not built yet."""

from __future__ import annotations

import argparse


def add_bench_args(p: argparse.ArgumentParser) -> None:
    pass


def run_bench(args: argparse.Namespace) -> int:
    raise ValueError("the serving benchmark is not built yet")
