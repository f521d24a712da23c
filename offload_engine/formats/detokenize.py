"""Text that grows token by token: incremental detokenisation and stop strings.

Decoding each new token alone breaks multi-byte characters and the spacing rules of some
tokenizers, so the text of a small window of recent tokens is decoded and only what it adds is
emitted; a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until it completes.
Text that could be the start of a stop string is held back too, and a completed stop string
ends the text just before it.
"""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | str | None = None):
        self._decode = decode
        self.stop = [s for s in ([stop] if isinstance(stop, str) else stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # all text so far (before any stop string)
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self._prefix = 0  # window start (token index)
        self._read = 0  # tokens whose text is already in self.text

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is safe to show now ('' if none)."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Everything still held back, at the end of generation (an incomplete character included)."""
        if not self.stopped and self._read < len(self.ids):
            before = self._decode(self.ids[self._prefix:self._read])
            self.text += self._decode(self.ids[self._prefix:])[len(before):]
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1 and at < end:
                end, self.stopped = at, True
        if self.stopped:
            self.text = self.text[:end]
        elif not final:
            end -= self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
