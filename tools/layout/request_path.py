"""Which files and functions of the package one chat request runs through (in-process engine, demo model).

    python -m tools.layout.request_path [--stream] [--list]

Builds the server as the tests do (AsyncEngine in this process), sends one warm-up chat request, then traces
the next one with sys.setprofile / threading.setprofile: every package function called while it runs, in
first-call order, with its file. Work done in the chat worker processes is not traced (the call that sends it
there is)."""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

SKIP = ("/tests/", "/tools/", "/.venv/")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--list", action="store_true", help="print every function in first-call order")
    args = ap.parse_args()
    import httpx

    import swaserve
    from swaserve import cli
    from tests.server.conftest import POOL_ARGS, LiveServer
    root = str(Path(swaserve.__file__).resolve().parent)
    try:
        from swaserve.engine.client.in_process import AsyncEngine
        from swaserve.models.architectures import load_model
    except ImportError:  # the tree before the house change
        from swaserve.engine.async_engine import AsyncEngine
        from swaserve.models.registry import load_model  # noqa: F401 - the tree before the house change
    from swaserve.engine.args import engine_config_from_args
    from swaserve.engine.engine import Engine
    from swaserve.server.app import build_app
    from swaserve.server.launch import server_config_from_args

    seen: dict[tuple[str, str], int] = {}
    real: dict[str, str] = {}  # co_filename -> the file it names (the package may be reached through a link)
    lock = threading.Lock()
    on = threading.Event()

    def prof(frame, event, arg):  # set before any thread starts: Python 3.11 cannot profile running threads
        if event != "call" or not on.is_set():
            return
        f = real.get(frame.f_code.co_filename) or real.setdefault(frame.f_code.co_filename,
                                                                  os.path.realpath(frame.f_code.co_filename))
        if f.startswith(root + os.sep) and not f.startswith("<") and not any(s in f for s in SKIP) \
                and not frame.f_code.co_filename.startswith("<"):
            key = (os.path.relpath(f, root), frame.f_code.co_qualname)
            with lock:
                seen.setdefault(key, len(seen))
    threading.setprofile(prof)
    sys.setprofile(prof)
    parse = lambda *a: cli.build_parser().parse_args(["serve", *POOL_ARGS, *a])
    cfg = engine_config_from_args(parse())
    eng = AsyncEngine(Engine(cfg, load_model(cfg, progress=False)))
    eng.start()
    srv = LiveServer(build_app(eng, server_config_from_args(parse())))
    body = {"model": "swaserve-demo", "max_tokens": 4, "temperature": 0, "stream": args.stream,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Hello"}]}
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        c.post("/v1/chat/completions", json=body).raise_for_status()
        on.set()
        try:
            c.post("/v1/chat/completions", json=body).raise_for_status()
        finally:
            on.clear()
    srv.stop()
    eng.shutdown()
    order = sorted(seen, key=seen.get)
    files: dict[str, None] = {}
    for f, _ in order:
        files.setdefault(f, None)
    folders = {str(Path(f).parent) for f in files}
    if args.list:
        for f, fn in order:
            print(f"{f}:{fn}")
    print(f"functions {len(order)}, files {len(files)}, folders {len(folders)}: {sorted(folders)}")
    for f in files:
        print("  ", f)


if __name__ == "__main__":
    sys.exit(main())
