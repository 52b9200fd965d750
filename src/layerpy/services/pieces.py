"""Long JSON answers encoded as their items come and sent a piece at a time, so that
neither the encoding nor a copy of the whole answer holds the event loop (see
layerpy.turns for the items themselves)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable
from typing import Any, TypeVar

from aiohttp import web

PIECE = 256 * 1024  # characters of an answer encoded at a time
T = TypeVar("T")


async def json_answer(
    request: web.Request,
    items: AsyncIterable[T],
    value: Callable[[T], Any],
    *,
    keyed: bool = False,
    headers: dict[str, str] | None = None,
) -> web.StreamResponse:
    """A JSON list of ``value(item)`` (or, `keyed`, an object of ``item: value(item)``),
    the text `web.json_response` would give, encoded as `items` come and sent a PIECE at
    a time: no copy of the whole answer (55 MB for the explain of 100 000 nodes) is
    ever made in one step."""
    response = web.StreamResponse(headers=headers)
    response.content_type, response.charset = "application/json", "utf-8"
    await response.prepare(request)
    send = request.method != "HEAD"  # a HEAD answer is its headers only
    opening, closing = ("{", "}") if keyed else ("[", "]")
    batch: list[str] = []
    size, sent = 0, False
    async for item in items:
        piece = json.dumps(value(item))
        batch.append(f"{json.dumps(item)}: {piece}" if keyed else piece)
        size += len(batch[-1])
        if size >= PIECE:
            if send:
                await response.write(((", " if sent else opening) + ", ".join(batch)).encode())
            batch, size, sent = [], 0, True
    if send:
        rest = ", ".join(batch)
        last = (", " + rest if rest else "") if sent else opening + rest
        await response.write((last + closing).encode())
    await response.write_eof()
    return response
