"""Reading server-sent event streams: text split into lines, the lines' ``data:`` payloads.

Lines end at "\\n" only (a "\\r" before it is dropped): SSE's line ends are CR/LF, while
str.splitlines and httpx's iter_lines / aiter_lines also split on U+2028, U+0085 and the like,
which JSON may carry raw inside an event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

DATA = "data: "
DONE = "[DONE]"


class _LineBuffer:
    """Text chunks in, complete lines out."""

    def __init__(self) -> None:
        self.rest = ""

    def feed(self, text: str) -> list[str]:
        *lines, self.rest = (self.rest + text).split("\n")
        return [line.rstrip("\r") for line in lines]

    def close(self) -> list[str]:
        return [self.rest.rstrip("\r")] if self.rest else []


def lines(chunks: Iterable[str]) -> Iterator[str]:
    """The lines of a stream of text chunks (e.g. httpx's ``Response.iter_text()``)."""
    buf = _LineBuffer()
    for text in chunks:
        yield from buf.feed(text)
    yield from buf.close()


async def alines(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines of an async stream of text chunks (e.g. httpx's ``Response.aiter_text()``)."""
    buf = _LineBuffer()
    async for text in chunks:
        for line in buf.feed(text):
            yield line
    for line in buf.close():
        yield line


def payload(line: str) -> str | None:
    """The payload of a ``data:`` line; None for any other line (comments, blank lines, other fields)."""
    return line[len(DATA):] if line.startswith(DATA) else None


def events(lines: Iterable[str]) -> Iterator[dict | str]:
    """The JSON payloads of an event stream's lines, and the string "[DONE]" where it comes."""
    for line in lines:
        data = payload(line)
        if data is not None:
            yield DONE if data == DONE else json.loads(data)
