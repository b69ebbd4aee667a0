"""Reading an OpenAI-compatible server's SSE stream (Baton's, or another's), one event at a time:
the one reader of the load tests, the benchmarks and the ``baton`` CLI."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Iterable, Iterator

DONE = b"data: [DONE]"


class StreamFailed(Exception):
    """The server sent an error event in the stream (after its 200)."""


def _event(line: bytes) -> dict | None:
    line = line.strip()
    if not line.startswith(b"data: ") or line == DONE:
        return None
    return json.loads(line[6:])


def events(lines: Iterable[bytes]) -> Iterator[dict]:
    """The JSON events of a stream's lines (``requests``' ``iter_lines``), up to ``[DONE]``."""
    for line in lines:
        if line.strip() == DONE:
            return
        if (event := _event(line)) is not None:
            yield event


async def aevents(lines: AsyncIterable[bytes]):
    """:func:`events` of an async stream of lines (``aiohttp``'s ``resp.content``)."""
    async for line in lines:
        if line.strip() == DONE:
            return
        if (event := _event(line)) is not None:
            yield event


def failure(event: dict) -> str | None:
    """An error event's message, else None."""
    error = event.get("error")
    if error is None:
        return None
    return error.get("message", str(error)) if isinstance(error, dict) else str(error)


def check(event: dict) -> dict:
    """``event``, or :class:`StreamFailed` if it is an error."""
    if (message := failure(event)) is not None:
        raise StreamFailed(message)
    return event


def token_ids(event: dict) -> list[int]:
    """Every choice's new token ids in the event (Baton's ``token_ids`` extension)."""
    return [t for choice in event.get("choices", ()) for t in choice.get("token_ids") or ()]
