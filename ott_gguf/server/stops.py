"""Stop strings in streamed text: what may be shown now, and where generation ends."""

from __future__ import annotations

from collections.abc import Sequence


class StopScanner:
    """Finds the first of a request's stop strings in text that arrives in pieces.

    feed() returns the text that is safe to show: everything before a stop string, less a
    tail that could still be the beginning of one (held until the next piece decides).
    After a stop string, `stopped` is True and the rest is dropped, the stop string included,
    as OpenAI does.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.stopped = False
        self._held = ""

    def feed(self, text: str) -> str:
        if not self.stops or self.stopped:
            return "" if self.stopped else text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        n_keep = max(_prefix_overlap(buf, s) for s in self.stops)
        self._held = buf[len(buf) - n_keep :]
        return buf[: len(buf) - n_keep]

    def flush(self) -> str:
        """The held tail, once generation has ended without a stop string."""
        held, self._held = self._held, ""
        return held


def _prefix_overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
