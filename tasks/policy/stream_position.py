"""Where a streamed call's client is: the SSE event id every event of a stream carries (pure).

A stream of ``n`` choices (several prompts, ``n`` choices each) interleaves its choices' chunks as their
tokens come, so the position after an event is one entry per choice, joined by dots:

- ``""``: the choice has not been opened (its role chunk, or the prompt it echoes, not sent yet);
- ``"42"``: opened, and the first 42 characters of its text sent;
- ``"42f"``: its last chunk (``finish_reason``, log-probabilities) sent as well;

and a trailing ``u`` once the usage chunk went out. ``7f.3`` says choice 0 is finished and choice 1 has 3
characters out. A client that lost its connection sends the id of the last event it got as ``Last-Event-ID``,
and the resumed stream sends exactly what comes after it (:mod:`tasks.gateway.resume`): text is counted in
characters of the choice's text, which the worker's journal and its final result both give, so the resumed
events continue the text where the client's stopped, whichever API process serves them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_ENTRY = re.compile(r"(?:(\d{1,9})(f?))?")
MAX_ID_CHARS = 4096  # an id longer than this is not one we sent


class BadPosition(ValueError):
    """A Last-Event-ID that is not one this stream's events carried."""


@dataclass(frozen=True)
class Choice:
    opened: bool = False
    sent: int = 0  # characters of its text the client has
    finished: bool = False

    def __str__(self) -> str:
        return "" if not self.opened else f"{self.sent}{'f' if self.finished else ''}"


@dataclass(frozen=True)
class Position:
    choices: tuple[Choice, ...]
    usage_sent: bool = False

    @classmethod
    def start(cls, n: int) -> Position:
        """Before the first event."""
        return cls(tuple(Choice() for _ in range(n)))

    @classmethod
    def parse(cls, event_id: str, n: int) -> Position:
        """The position an event id names, for a stream of ``n`` choices (BadPosition: not such an id)."""
        if len(event_id) > MAX_ID_CHARS:
            raise BadPosition("the Last-Event-ID is too long")
        usage = event_id.endswith("u")
        parts = (event_id[:-1] if usage else event_id).split(".")
        if len(parts) != n:
            raise BadPosition(f"the Last-Event-ID names {len(parts)} choices; this stream has {n}")
        choices = []
        for part in parts:
            match = _ENTRY.fullmatch(part)
            if match is None:
                raise BadPosition(f"the Last-Event-ID has an entry {part[:20]!r} that is no position")
            sent, finished = match.groups()
            choices.append(Choice(opened=sent is not None, sent=int(sent or 0), finished=finished == "f"))
        if usage and not all(c.finished for c in choices):
            raise BadPosition("the Last-Event-ID says usage was sent before every choice finished")
        return cls(tuple(choices), usage)

    def __str__(self) -> str:
        return ".".join(str(c) for c in self.choices) + ("u" if self.usage_sent else "")

    def _with(self, index: int, choice: Choice) -> Position:
        return Position((*self.choices[:index], choice, *self.choices[index + 1:]), self.usage_sent)

    def opened(self, index: int) -> Position:
        return self._with(index, Choice(opened=True))

    def advanced(self, index: int, chars: int) -> Position:
        c = self.choices[index]
        return self._with(index, Choice(True, c.sent + chars, c.finished))

    def finished(self, index: int, length: int) -> Position:
        """Its last chunk went out: the client has the whole text, ``length`` characters."""
        return self._with(index, Choice(True, length, True))

    def with_usage(self) -> Position:
        return Position(self.choices, True)

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)


def text_after(sent: int, offset: int, text: str) -> str:
    """Of a piece of a choice's text that starts ``offset`` characters in, what a client that has ``sent``
    characters lacks ("" when it has all of it)."""
    return text[max(0, sent - offset):] if offset + len(text) > sent else ""
