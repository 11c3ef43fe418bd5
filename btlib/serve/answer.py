"""An answer's JSON, written within a byte limit as a body is read within one, and off the event loop when big.

    out = Answers(limit=32_000_000)
    text = out.write(Array(row.tolist() for row in rows))       # b"[[...],[...]]", or a 413 naming the limit
    response = await out.respond(lambda: Array(...), big=True, headers=...)   # built and written on a worker thread

An answer was built whole, then written whole, on the event loop: /tokenize of a 1.9 MB text answered 65 MB (and
kept every connection, /health included, waiting 2.4 s), and /embed_all of 256 texts of 256 tokens would answer
~500 MB. Here an answer is a tree of JSON values where an :class:`Array` is written element by element (a row, a
token), so the text is counted as it grows and refused (413) as soon as it passes the limit: the memory an answer
takes is bounded by the limit plus one element, whatever the request. :class:`Run` elements are written by one
to_json call (a slice of /tokenize's token objects), which keeps the count cheap. Every piece is btlib.serve.bodies'
to_json, so an answer's text is the one to_json writes for the whole tree (orjson: byte for byte). An answer whose
size is known to be within the limit before it is written (``most``: rows of floats, FLOAT_CHARS each at most) is
written by one to_json call: pieces cost ~1.5x the time of one call for 64 rows of 384 floats.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Iterable

from fastapi.responses import Response

from .bodies import to_json
from .guards import HTTPError

__all__ = ["ANSWER_FACTOR", "FLOAT_CHARS", "Array", "Run", "Answers"]

ANSWER_FACTOR = 16  # the default answer limit, in payload limits: 32 MB beside TEI's 2 MB bodies
FLOAT_CHARS = 26  # a float's text at most: its shortest repr ("-2.2250738585072014e-308", 24) and json's ", "


class Array:
    """A JSON array written element by element: ``items`` (any iterable, a generator included) of JSON values,
    Arrays, Runs, or dicts whose values may be Arrays."""

    def __init__(self, items: Iterable):
        self.items = items


class Run(list):
    """Consecutive elements of the enclosing Array, written by one to_json call (a slice of many small objects)."""


class Answers:
    """Writes every answer of one server within ``limit`` bytes (a 413 naming it beyond)."""

    def __init__(self, limit: int):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"answer_limit must be a positive int (bytes); got {limit!r}")
        self.limit = limit

    def too_large(self, least: int | None = None) -> HTTPError:
        size = f"would be at least {least:,} bytes, past" if least else "would pass"
        return HTTPError(413, f"this answer {size} this server's limit of {self.limit:,} bytes "
                              "(python -m btlib.serve --answer-limit BYTES raises it); ask for less in one request: fewer "
                              "or shorter inputs", "payload_too_large")

    def write(self, obj, most: int | None = None) -> bytes:
        """``obj`` as UTF-8 JSON, or the 413 once its text passes the limit; ``most``: an upper bound of its size
        (None: unknown), which within the limit lets one to_json call write it whole."""
        if most is not None and most <= self.limit:
            return to_json(_plain(obj))
        out: list[bytes] = []
        size = 0

        def put(piece: bytes) -> None:
            nonlocal size
            size += len(piece)
            if size > self.limit:
                raise self.too_large()
            out.append(piece)

        def emit(x) -> None:
            if isinstance(x, Array):
                put(b"[")
                first = True
                for item in x.items:
                    if isinstance(item, Run) and not item:
                        continue
                    if not first:
                        put(b",")
                    first = False
                    if isinstance(item, Run):
                        put(to_json(list(item))[1:-1])  # its elements, without their brackets
                    else:
                        emit(item)
                put(b"]")
            elif isinstance(x, dict) and any(isinstance(v, Array) for v in x.values()):
                put(b"{")
                for i, (k, v) in enumerate(x.items()):
                    put((b"," if i else b"") + to_json(k) + b":")
                    emit(v)
                put(b"}")
            else:
                put(to_json(x))

        emit(obj)
        return b"".join(out)

    async def respond(self, build: Callable[[], object], big: bool, headers: dict | None = None,
                      least: int = 0, most: int | None = None) -> Response:
        """The JSON answer of ``build()``, built and written on a worker thread when ``big`` (the event loop answers
        every connection, /health included), else here. ``least``: a lower bound of its size known before anything is
        built (floats x 3 bytes): past the limit, the 413 comes without building it; ``most``: :meth:`write`'s."""
        if least > self.limit:
            raise self.too_large(least)
        if big:
            text = await asyncio.get_running_loop().run_in_executor(None, lambda: self.write(build(), most))
        else:
            text = self.write(build(), most)
        return Response(text, media_type="application/json", headers=headers)


def _plain(x):
    """``x`` with its Arrays as lists (Runs spliced in): what to_json writes whole."""
    if isinstance(x, Array):
        out = []
        for item in x.items:
            if isinstance(item, Run):
                out.extend(item)
            else:
                out.append(_plain(item))
        return out
    if isinstance(x, dict) and any(isinstance(v, Array) for v in x.values()):
        return {k: _plain(v) for k, v in x.items()}
    return x
