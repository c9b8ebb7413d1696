"""Stop strings at the engine, as vLLM's engine applies them: smg matches `stop` on the text it
detokenizes and cuts the response there, but waits for the engine's `complete` (it sends no
Abort), so an engine that ran on to `max_tokens` would hold the client that long. With the
tokenizer of `--tokenizer DIR` (its tokenizer.json, through the `tokenizers` library), the
gateway port decodes each request's newest tokens and ends the request at the first stop
string; without one, stop strings are the gateway's alone (docs/GATEWAY.md).

The check decodes a window: the last WINDOW tokens before the new ones, and the new ones. A
match seen there is new: an earlier window held any earlier text the match could cover.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("kvsched.gateway")
WINDOW = 64  # tokens of context kept before the newest ones: covers stop strings that long


class StopMatcher:
    """One request's stop strings over its output ids."""

    def __init__(self, tokenizer: Any, stops: list[str], skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip_special = skip_special

    def _found(self, ids: list[int], start: int, end: int) -> str | None:
        """The stop string found first in the text of ids[start - WINDOW : end] (or None)."""
        window = ids[max(0, start - WINDOW) : end]
        text = self.tokenizer.decode(window, skip_special_tokens=self.skip_special)
        found = [(text.find(s), s) for s in self.stops if s in text]
        return min(found)[1] if found else None

    def match(self, ids: list[int], base: int) -> tuple[int, str] | None:
        """`ids` are a request's output ids, those from `base` on new. When a stop string shows
        in their text: (n, stop), n the fewest ids whose text holds it (vLLM stops at the token
        that completes the match); else None."""
        if self._found(ids, base, len(ids)) is None:
            return None
        for n in range(base + 1, len(ids) + 1):
            if (hit := self._found(ids, base, n)) is not None:
                return n, hit
        return None  # pragma: no cover (the whole window matched above)


class StopStrings:
    """The daemon's tokenizer for stop strings, loaded at first use (None: not available)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.dir = tokenizer_dir
        self._tok: Any = None
        self._tried = False

    def tokenizer(self) -> Any:
        if not self._tried:
            self._tried = True
            path = Path(self.dir) / "tokenizer.json" if self.dir else None
            if path is not None and path.is_file():
                try:
                    from tokenizers import Tokenizer

                    self._tok = Tokenizer.from_file(str(path))
                except Exception as exc:  # no library, or a file it cannot read
                    log.warning("stop strings left to the gateway: %s", exc)
        return self._tok

    def matcher(self, stops: list[str], skip_special: bool) -> StopMatcher | None:
        """A matcher for these stop strings, or None (none given, or no tokenizer)."""
        stops = [s for s in stops if s]
        tok = self.tokenizer() if stops else None
        return StopMatcher(tok, stops, skip_special) if tok is not None else None
