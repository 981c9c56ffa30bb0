"""Per-choice output text: incremental detokenization plus stop strings that may span tokens."""

from __future__ import annotations

from collections.abc import Sequence

from swaserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    """Per-choice text: incremental detokenization plus stop strings that may span tokens. Text that
    could still be the start of a stop string is held back; a matched stop string and everything
    after it are cut."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], skip_special_tokens: bool,
                 mark_special_tokens: bool = False, include_stop: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens,
                                            mark_special_tokens=mark_special_tokens)
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop  # the matched stop string stays at the end of the text
        self.held = ""

    def _process(self, new: str, final: bool) -> tuple[str, str | None]:
        buf = self.held + new
        if self.stop:
            best = None
            for s in self.stop:
                i = buf.find(s)
                if i >= 0 and (best is None or i < best[0]):
                    best = (i, s)
            if best is not None:
                self.held = ""
                end = best[0] + (len(best[1]) if self.include_stop else 0)
                return buf[:end], best[1]
        if final or not self.stop:
            self.held = ""
            return buf, None
        keep = 0
        for s in self.stop:  # longest suffix of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def push(self, token_id: int) -> tuple[str, str | None]:
        """(text to emit, matched stop string or None)."""
        return self._process(self.detok.push(token_id), final=False)

    def finish(self) -> tuple[str, str | None]:
        return self._process(self.detok.flush(), final=True)
