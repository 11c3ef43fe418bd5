"""The request bodies btlib.serve's routes take, parsed as TEI's and OpenAI's servers parse them, and their answers' JSON.

Strict: a field takes its JSON type only ("128" is not an int, "false" not a bool), and an unknown field is refused
by name (it was ignored, so a ``prompt_name`` the server did not know gave the default prompt's vector without a
word). A body is UTF-8 JSON (RFC 8259; TEI's serde_json): json.loads(bytes) would guess UTF-16 / UTF-32. A big body
is parsed, and a big answer written, off the event loop, which answers every connection (/health included).

Answers are written by orjson where it imports (the ``serve`` extra installs it): 8 x 384 floats in ~0.09 ms where
json.dumps took ~1.6 ms (AMD EPYC Zen 4). Both write a Python float as its shortest round-trip repr, so the text
parses to the same float64 values (float32 rows' .tolist() included); without orjson the json path answers the same.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from typing import Annotated, Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .guards import HTTPError, TooLarge, error_response

try:
    import orjson  # the serve extra (btlib[serve]) installs it; json.dumps answers the same where it is missing
except ImportError:
    orjson = None

__all__ = ["OFF_LOOP_BYTES", "OpenAIEmbeddingRequest", "TEIEmbedRequest", "TEIEmbedAllRequest", "TEIRerankRequest",
           "RerankDocumentsRequest", "TEIPredictRequest", "TEISimilarityRequest", "TEITokenizeRequest", "TEIDecodeRequest",
           "parse", "read_json", "validate", "check", "answers", "to_json", "dumps"]

OFF_LOOP_BYTES = 16_384  # a body past this is parsed and tokenized off the event loop (~2 ms of tokenizing on it at most)
MAX_FIELDS = 64  # keys of one JSON object at most: no body takes more than 8, and each unknown key was one more error
SHOWN_ERRORS = 8  # a 422 names this many of a body's errors, then counts the rest
_log = logging.getLogger("btlib.serve")

# strict: a field takes its JSON type only ("128" is not an int, "false" not a bool), as TEI's and OpenAI's servers
# parse; extra="forbid": an unknown field is refused by name, never ignored.
_STRICT = ConfigDict(extra="forbid", strict=True)



def _many(item):
    """list[item] whose validation stops at its first bad element: a 1.8 MB list of ``true`` was 900,000 errors (one per
    element and union branch), 10 s holding the GIL and a 52 MB message."""
    return Annotated[list[item], Field(fail_fast=True)]


# a text, texts, or token ids (one input's, or one list per input), as TEI's and OpenAI's inputs; not mixed
TextInputs = str | _many(str) | _many(int) | _many(_many(int))
Direction = Literal["right", "Right", "left", "Left"]
LongInputs = Literal["refuse", "truncate", "chunk"]  # btlib's fields (not TEI's or OpenAI's): btlib.pretrained.chunking


class OpenAIEmbeddingRequest(BaseModel):
    model_config = _STRICT
    input: TextInputs
    model: str | None = None  # any name: one model is served, and answers report its own name
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # OpenAI's end-user id for abuse monitoring: accepted, changes no answer
    prompt_name: str | None = None  # not OpenAI's: TEI's field, for a model whose queries need a prompt
    long_inputs: LongInputs | None = None  # btlib's: None is the server's --long-inputs
    chunk_overlap: int | None = None  # btlib's: tokens consecutive chunks share (long_inputs "chunk")


class TEIEmbedRequest(BaseModel):
    model_config = _STRICT
    inputs: TextInputs
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None
    dimensions: int | None = None
    long_inputs: LongInputs | None = None  # btlib's, as OpenAIEmbeddingRequest's
    chunk_overlap: int | None = None


class TEIEmbedAllRequest(BaseModel):  # /embed_all and /embed_sparse take the same fields (TEI's types.rs)
    model_config = _STRICT
    inputs: TextInputs
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class TEIRerankRequest(BaseModel):
    model_config = _STRICT
    query: str
    texts: _many(str)
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool | None = None
    truncation_direction: Direction = "right"


class RerankDocumentsRequest(BaseModel):  # Cohere's and Jina's /rerank body (``documents``, ``top_n``)
    model_config = _STRICT
    query: str
    documents: _many(str)
    top_n: int | None = None
    return_documents: bool = False  # Cohere's default; Jina's is true
    model: str | None = None  # any name, as /v1/embeddings


class PredictParameters(BaseModel):  # huggingface_hub's text_classification sends them
    model_config = _STRICT
    function_to_apply: Literal["sigmoid", "softmax", "none"] | None = None
    top_k: int | None = None


class TEIPredictRequest(BaseModel):
    model_config = _STRICT
    inputs: str | _many(str) | _many(_many(str))  # TEI: a text, a pair [a, b], or a batch of texts [a] and pairs
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: bool = False
    parameters: PredictParameters | None = None


class SimilarityInputs(BaseModel):
    model_config = _STRICT
    source_sentence: str
    sentences: _many(str)


class SimilarityParameters(BaseModel):
    model_config = _STRICT
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class TEISimilarityRequest(BaseModel):
    model_config = _STRICT
    inputs: SimilarityInputs
    parameters: SimilarityParameters | None = None


class TEITokenizeRequest(BaseModel):
    model_config = _STRICT
    inputs: str | _many(str)
    add_special_tokens: bool = True
    prompt_name: str | None = None


class TEIDecodeRequest(BaseModel):
    model_config = _STRICT
    ids: _many(int) | _many(_many(int))
    skip_special_tokens: bool = True


def _json_content_type(value: str) -> bool:
    """application/json or application/*+json, parameters (charset) ignored: the bodies FastAPI parses as JSON."""
    kind = value.partition(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def parse(request: Request, model) -> BaseModel:
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


def validate(body: bytes, model) -> BaseModel:
    """``body`` read as a JSON object (:func:`read_json`) and checked by ``model`` (:func:`check`); ``model`` may be a
    function of the object that names the class (POST / and /rerank take one of several bodies by their fields)."""
    data = read_json(body)
    return check(data, model if isinstance(model, type) else model(data))


class _NotJSON(ValueError):
    """What the parser's hooks refuse: a message for the client."""


def _fields(pairs: list) -> dict:
    if len(pairs) > MAX_FIELDS:
        raise _NotJSON(f"an object of {len(pairs):,} fields: no body here takes more than {MAX_FIELDS} (GET /openapi.json "
                       "lists each route's fields)")
    return dict(pairs)


def _constant(name: str):
    raise _NotJSON(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def read_json(body: bytes) -> dict:
    """A request body as a JSON object, or a 422 saying why it is not one, whatever its depth or size: nesting past
    Python's recursion limit (~1,000 levels; RecursionError) and an integer past Python's 4,300 digits (ValueError)
    were 500s."""
    try:
        # decoded as UTF-8 first: json.loads(bytes) guesses UTF-16 / UTF-32 and decodes with surrogatepass, so a
        # UTF-32 body was answered and a surrogate's 3 bytes became a field name; JSON between systems is UTF-8
        # (RFC 8259 8.1), as TEI's serde_json reads it
        data = json.loads(body.decode("utf-8"), object_pairs_hook=_fields, parse_constant=_constant)
    except json.JSONDecodeError as e:
        raise HTTPError(422, f"malformed request body: {e.pos}: JSON decode error ({e.msg})", "invalid_request_error") from None
    except UnicodeDecodeError as e:
        raise HTTPError(422, f"malformed request body: byte {e.start} is not UTF-8 ({e.reason})", "invalid_request_error") from None
    except _NotJSON as e:
        raise HTTPError(422, f"malformed request body: {e}", "invalid_request_error") from None
    except RecursionError:
        raise HTTPError(422, "malformed request body: arrays or objects nested too deeply for the parser (~1,000 levels; "
                             "a body here nests 3 at most)", "invalid_request_error") from None
    except ValueError:  # the only other one json.loads raises: int("...") past sys.get_int_max_str_digits()
        raise HTTPError(422, f"malformed request body: an integer of more than {sys.get_int_max_str_digits():,} digits "
                             "(no field takes one that long)", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise HTTPError(422, "malformed request body: body: send a JSON object", "invalid_request_error")
    return data


def check(data: dict, model: type[BaseModel]) -> BaseModel:
    """``data`` validated by ``model``, or a 422 naming the bad fields ("input.str: Input should be ..."), the first
    SHOWN_ERRORS of them, and the first as its ``param``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        fields = ", ".join(model.model_fields)
        errors = exc.errors(include_url=False)
        parts = [f"unknown field {'.'.join(str(x) for x in e['loc'])!r}: this route takes {fields}"
                 if e["type"] == "extra_forbidden" else f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}"
                 for e in errors[:SHOWN_ERRORS]]
        more = f"; and {len(errors) - SHOWN_ERRORS} more" if len(errors) > SHOWN_ERRORS else ""
        param = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
        raise HTTPError(422, "malformed request body: " + "; ".join(parts) + more, "invalid_request_error",
                        param=param) from None


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


def to_json(obj, fast: bool = True) -> bytes:
    """``obj`` as UTF-8 JSON: orjson's where it imports and ``fast``, else json.dumps' (the same values: both write a
    float's shortest round-trip repr; json's separators have spaces, orjson's none). NaN / inf are not JSON: json.dumps
    writes them bare, orjson null; an embedding has neither."""
    if fast and orjson is not None:
        return orjson.dumps(obj)
    return json.dumps(obj).encode()


async def dumps(obj, big: bool) -> bytes:
    """:func:`to_json`, off the event loop when the answer is big (json.dumps took ~2 ms for 8 x 384 floats; orjson ~0.1)."""
    if big:
        return await asyncio.get_running_loop().run_in_executor(None, to_json, obj)
    return to_json(obj)
