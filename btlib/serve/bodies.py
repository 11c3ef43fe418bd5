"""The request bodies btlib.serve's routes take, parsed as TEI's and OpenAI's servers parse them, and their answers' JSON.

Strict: a field takes its JSON type only ("128" is not an int, "false" not a bool), and an unknown field is refused
by name (it was ignored, so a ``prompt_name`` the server did not know gave the default prompt's vector without a
word). A body is UTF-8 JSON (RFC 8259; TEI's serde_json): json.loads(bytes) would guess UTF-16 / UTF-32. A big body
is parsed, and a big answer written, off the event loop, which answers every connection (/health included).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from .guards import HTTPError, TooLarge, error_response

__all__ = ["OFF_LOOP_BYTES", "OpenAIEmbeddingRequest", "TEIEmbedRequest", "TEIRerankRequest", "parse", "validate", "answers",
           "dumps"]

OFF_LOOP_BYTES = 16_384  # a body past this is parsed and tokenized off the event loop (~2 ms of tokenizing on it at most)
_log = logging.getLogger("btlib.serve")

# strict: a field takes its JSON type only ("128" is not an int, "false" not a bool), as TEI's and OpenAI's servers
# parse; extra="forbid": an unknown field is refused by name, never ignored.
_STRICT = ConfigDict(extra="forbid", strict=True)


class OpenAIEmbeddingRequest(BaseModel):
    model_config = _STRICT
    input: str | list[str]
    model: str | None = None  # any name: one model is served, and answers report its own name
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, changes no answer
    prompt_name: str | None = None  # not OpenAI's: TEI's field, for a model whose queries need a prompt


class TEIEmbedRequest(BaseModel):
    model_config = _STRICT
    inputs: str | list[str]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"
    prompt_name: str | None = None
    dimensions: int | None = None


class TEIRerankRequest(BaseModel):
    model_config = _STRICT
    query: str
    texts: list[str]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Literal["right", "Right", "left", "Left"] = "right"


def _json_content_type(value: str) -> bool:
    """application/json or application/*+json, parameters (charset) ignored: the bodies FastAPI parses as JSON."""
    kind = value.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body validated by ``model``, or a 422 naming each bad field ("input.str: Input should be ...").

    What FastAPI did for a body parameter, in the same steps (json.loads, then pydantic on the dict, so the messages
    are pydantic's Python-mode ones, as before) without its dependency solving. Bodies FastAPI would not read as
    JSON (no Content-Type, or not application/json or */*+json) are refused as FastAPI refused them.
    """
    if not _json_content_type(request.headers.get("content-type", "")):
        raise HTTPError(422, "malformed request body: send JSON with Content-Type: application/json", "invalid_request_error")
    body = await request.body()
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.get_running_loop().run_in_executor(None, validate, body, model)
    return validate(body, model)


def validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    try:
        # decoded as UTF-8 first: json.loads(bytes) guesses UTF-16 / UTF-32 and decodes with surrogatepass, so a
        # UTF-32 body was answered and a surrogate's 3 bytes became a field name; JSON between systems is UTF-8
        # (RFC 8259 8.1), as TEI's serde_json reads it
        data = json.loads(body.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise HTTPError(422, f"malformed request body: {e.pos}: JSON decode error ({e.msg})", "invalid_request_error") from None
    except UnicodeDecodeError as e:
        raise HTTPError(422, f"malformed request body: byte {e.start} is not UTF-8 ({e.reason})", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise HTTPError(422, "malformed request body: body: send a JSON object", "invalid_request_error")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = ", ".join(model.model_fields)
        parts = [f"unknown field {'.'.join(str(x) for x in e['loc'])!r}: this route takes {fields}"
                 if e["type"] == "extra_forbidden" else f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}"
                 for e in exc.errors(include_url=False)]
        raise HTTPError(422, "malformed request body: " + "; ".join(parts), "invalid_request_error") from None


def answers(endpoint):
    """A route whose unexpected error is a 500 in the route's error shape, logged, on a connection that stays open
    (an exception escaping the route reached uvicorn, which reset the connection without ``Connection: close``).
    :class:`TooLarge` passes through to :class:`BodyLimit`, which answers it."""

    @functools.wraps(endpoint)
    async def wrapped(request: Request):
        try:
            return await endpoint(request)
        except (HTTPError, TooLarge):
            raise
        except Exception as e:  # noqa: BLE001 - the server's bug or the model's: said, not hidden behind a reset
            _log.exception("%s %s failed", request.method, request.url.path)
            return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}", "server_error")

    return wrapped


async def dumps(obj, big: bool) -> str:
    """json.dumps, off the event loop when the answer is big (8 x 384 floats took ~2 ms to write)."""
    if big:
        return await asyncio.get_running_loop().run_in_executor(None, json.dumps, obj)
    return json.dumps(obj)
