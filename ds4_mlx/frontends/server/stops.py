"""Stop strings over the visible text stream [stop_list_find_from, stop_list_stream_safe_len].

The earliest match wins and the text is cut there.  While streaming, the last ``max_len - 1``
characters are held back: a stop string may begin there and end in the next token.  A match
always starts in the held-back part: anything earlier was already searched with the whole stop
string in view.  Reasoning and content are one text here, as in ds4 (which matches the raw
generated text); tool-call events flush the held text and are not matched."""

from __future__ import annotations


class StopFilter:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._segments: list[tuple[type, str]] = []
        self.hit = False

    def feed(self, kind: type, text: str) -> list[tuple[type, str]]:
        """Pieces (event class, text) safe to send now; sets ``hit`` when a stop string matched."""
        if self.hit or not text:
            return []
        if not self.stops:
            return [(kind, text)]
        self._segments.append((kind, text))
        pending = "".join(t for _, t in self._segments)
        best = -1
        for s in self.stops:
            k = pending.find(s)
            if k >= 0 and (best < 0 or k < best):
                best = k
        if best >= 0:
            self.hit = True
            out = self._take(best)
            self._segments = []
            return out
        return self._take(max(0, len(pending) - self.hold))

    def flush(self) -> list[tuple[type, str]]:
        out = [(k, t) for k, t in self._segments if t]
        self._segments = []
        return out

    def _take(self, n: int) -> list[tuple[type, str]]:
        out: list[tuple[type, str]] = []
        rest: list[tuple[type, str]] = []
        for kind, text in self._segments:
            if n <= 0:
                rest.append((kind, text))
            elif len(text) <= n:
                out.append((kind, text))
                n -= len(text)
            else:
                out.append((kind, text[:n]))
                rest.append((kind, text[n:]))
                n = 0
        self._segments = rest
        return out
