"""Child processes of `swaserve fleet`: started in their own session (a terminal's Ctrl-C reaches only the
fleet, which stops them in order), killed with the fleet if it dies (Linux PR_SET_PDEATHSIG), their
output relayed line by line with a prefix naming the child (and copied to a log file)."""

from __future__ import annotations

import ctypes
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import IO

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # smg colours its log even into a pipe
_PR_SET_PDEATHSIG = 1
_OUTPUT_LOCK = threading.Lock()


try:  # resolved here, not in the forked child (no dynamic loading between fork and exec)
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the fleet's own shutdown still stops its children
    _PRCTL = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))


class Child:
    """One started process: `name` prefixes its relayed lines; `log_path` (optional) gets them too."""

    def __init__(self, name: str, argv: list[str], log_path: str | None = None,
                 sink: IO[str] | None = None, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.sink = sink if sink is not None else sys.stdout
        self.tail: deque[str] = deque(maxlen=20)  # last lines, for an error message
        self.started_at = time.monotonic()
        self._terminated = False
        log = open(log_path, "a", buffering=1, encoding="utf-8") if log_path else None
        child_env = dict(os.environ if env is None else env)
        child_env.setdefault("PYTHONUNBUFFERED", "1")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent, env=child_env)
        self._pump = threading.Thread(target=self._relay, args=(log,), name=f"fleet-log-{name}", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def _relay(self, log: IO[str] | None) -> None:
        assert self.proc.stdout is not None
        try:
            for raw in self.proc.stdout:
                line = _ANSI.sub("", raw.decode("utf-8", errors="replace")).rstrip()
                if not line:
                    continue
                self.tail.append(line)
                if log is not None:
                    log.write(line + "\n")
                with _OUTPUT_LOCK:
                    try:
                        self.sink.write(f"[{self.name}] {line}\n")
                        self.sink.flush()
                    except (OSError, ValueError):  # our own stdout went away: keep the child's log
                        pass
        finally:
            if log is not None:
                log.close()

    def terminate(self) -> None:
        """SIGTERM to the child's process group, once (stop() then waits for it)."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self._signal(signal.SIGTERM)

    def stop(self, timeout: float) -> int | None:
        """SIGTERM to the child's process group, SIGKILL after `timeout` s; returns the exit code."""
        if self.alive():
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(10)
        self._signal(signal.SIGKILL)  # anything the child left behind in its group
        self._pump.join(5)
        return self.proc.returncode

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_until(check: Callable[[], bool], timeout: float, alive: Callable[[], bool] = lambda: True,
               stop: threading.Event | None = None, interval: float = 0.25) -> bool:
    """Poll `check` until it is true (True), `timeout` passes, `alive()` turns false or `stop` is set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        if not alive() or (stop is not None and stop.is_set()):
            return False
        time.sleep(interval)
    return check()


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0) -> bytes | None:
    """The body of GET `url` if it answers 2xx within `timeout` s, else None (stdlib only)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.read()
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
        return None


def http_ok(url: str, headers: dict[str, str] | None = None) -> bool:
    """True when GET `url` answers 2xx within 5 s."""
    return http_get(url, headers) is not None


def healthy_workers(router_url: str, headers: dict[str, str] | None = None) -> set[str]:
    """Worker URLs smg lists as healthy (GET /workers on the router)."""
    body = http_get(f"{router_url}/workers", headers)
    try:
        return {w["url"] for w in json.loads(body or b"{}").get("workers", []) if w.get("is_healthy")}
    except (ValueError, KeyError, TypeError, AttributeError):
        return set()
