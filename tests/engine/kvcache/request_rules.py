"""The request rules both cache state machines share (test helper): start a request, or serve one whole.
A machine subclasses RequestRules and gives `running`, `_start(data)` (a new request, or None when the
draw makes none) and `_advance(req, data)` (one step of a running request)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule


class RequestRules(RuleBasedStateMachine):
    running: Any

    def _start(self, data: Any) -> Any:
        raise NotImplementedError

    def _advance(self, req: Any, data: Any) -> None:
        raise NotImplementedError

    @precondition(lambda self: len(self.running) < 3)
    @rule(data=st.data())
    def start(self, data: Any) -> None:
        self._start(data)

    @precondition(lambda self: len(self.running) < 3)
    @rule(data=st.data())
    def serve(self, data: Any) -> None:
        """A whole request at once: admission, its chunks (inserts, drops) and its finish."""
        r = self._start(data)
        while r is not None and r in self.running:
            self._advance(r, data)
