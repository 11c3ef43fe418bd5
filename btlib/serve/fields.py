"""Which request fields each route takes on each model kind, and how every one is checked: one table, one function.

    c = fields(svc, "embed", body)     # Fields(mode="refuse", prompt_name=None, dimensions=None, chunk_overlap=None)
    ran = await svc.embed(body.inputs, c.mode, "inputs", c.prompt_name, output, c.chunk_overlap)

Each route checked its own fields, and one forgot: SPLADE's /embed answered ``truncate`` and ``long_inputs`` that
disagree (long_inputs won, silently) and ignored ``chunk_overlap``, which the dense /embed refused. Now every route
calls :func:`fields`, so a field means the same wherever a body has it. ``ROUTES[route][kind]`` is a route's
:class:`Rule` on a model of that kind ("dense", "sparse" (SPLADE), "reranker"); a kind the route does not list is
TEI's 424 (btlib.serve.service.Service.holds says which server to start). Each field, where the body has it:

    truncation_direction   "right" only (Service.truncation)
    truncate, long_inputs  the long-input mode (Service.long_mode: 422 where they disagree; else the server's mode).
                           "chunk" on a route that cannot pool a text's chunks (Rule.chunks false): 422 when the body
                           asks for it; the server's "chunk" refuses (413) a long input there rather than cut it
    chunk_overlap          422 unless the mode is "chunk" and 0 <= chunk_overlap < the chunk window, whether or not a
                           text needs chunking (it was answered when none did)
    prompt_name            one of the model's prompts (Service.check_prompt)
    dimensions             1..width where the rule takes it (Service.check_dimensions); 422 elsewhere
"""

from __future__ import annotations

from dataclasses import dataclass

from ..pretrained.chunking import check_long_inputs, windows
from .guards import HTTPError

__all__ = ["Rule", "Fields", "ROUTES", "fields", "model_kind", "chunk_window", "check_overlap"]


@dataclass(frozen=True)
class Rule:
    """What a route can do with a long-input and a shape field on one model kind."""

    chunks: bool = False  # its answer pools a chunked text's rows into the text's one row
    dimensions: bool = False  # its rows can be cut to ``dimensions`` (Matryoshka)


_ANY = {"dense": Rule(), "sparse": Rule(), "reranker": Rule()}
ROUTES: dict[str, dict[str, Rule]] = {
    "embed": {"dense": Rule(chunks=True, dimensions=True),
              "sparse": Rule()},  # TEI's embed_pooled: the dense (vocab,) rows, no chunk pooling or Matryoshka defined
    "embeddings": {"dense": Rule(chunks=True, dimensions=True)},  # OpenAI's /v1/embeddings
    "similarity": {"dense": Rule(chunks=True)},
    "embed_all": {"dense": Rule()},  # a row per token: no one row to pool chunks into
    "embed_sparse": {"sparse": Rule()},
    "rerank": {"reranker": Rule()},  # (query, text) pairs: cut longest-first, never chunked
    "predict": {"reranker": Rule()},
    "tokenize": _ANY,
}


@dataclass(frozen=True)
class Fields:
    """A body's checked fields: what the route runs with."""

    mode: str  # "refuse" | "truncate" | "chunk" (btlib.pretrained.chunking)
    prompt_name: str | None = None
    dimensions: int | None = None
    chunk_overlap: int | None = None  # the request's (None: the server's)


def model_kind(svc) -> str:
    return "reranker" if svc.reranker else "sparse" if svc.sparse else "dense"


def chunk_window(model, prompt_name: str | None) -> int:
    """Content tokens per chunk for ``prompt_name`` (None: the model's default prompt, if any): max_length less the
    special tokens around a text and the prompt's tokens, btlib.pretrained.chunking.chunk_tokens' window."""
    tok = model.tokenizer
    specials = sum(tok.encode("a").special_tokens_mask)  # the special tokens around any text
    resolve = getattr(model, "resolve_prompt", None)
    prompt = resolve(None, prompt_name) if resolve else None
    return model.max_length - specials - (len(tok.encode(prompt, add_special_tokens=False).ids) if prompt else 0)


def check_overlap(model, overlap: int, prompt_name: str | None) -> None:
    """ValueError unless ``overlap`` is an int with 0 <= overlap < :func:`chunk_window` (chunking's own messages)."""
    check_long_inputs("chunk", overlap)
    windows(0, chunk_window(model, prompt_name), overlap)


def _refuse_kind(svc, kinds) -> None:
    """The 424 for a server whose model kind is not in ``kinds``, in Service.holds' words."""
    if "reranker" in kinds:
        svc.holds("reranker")
    if svc.reranker or "dense" in kinds:
        svc.holds("embedding")
    svc.holds("sparse")


def fields(svc, route: str, body) -> Fields:
    """``body``'s fields (any of the module docstring's; None for a route's absent parameters) checked for ``route``
    on ``svc``'s model: a 424 for a model kind the route does not serve, a 422 naming the field at fault."""
    kinds = ROUTES[route]
    rule = kinds.get(model_kind(svc))
    if rule is None:
        _refuse_kind(svc, kinds)
    field = lambda name: getattr(body, name, None)  # noqa: E731 - a body (or its parameters) may lack any field
    prompt_name, dimensions = field("prompt_name"), field("dimensions")
    overlap, asked = field("chunk_overlap"), field("long_inputs")
    if dimensions is not None:
        if not rule.dimensions:
            raise HTTPError(422, f"dimensions: /{route} on this model has no features to keep (Matryoshka applies to a "
                                 "dense model's pooled rows); leave dimensions out", "Validation", param="dimensions")
        svc.check_dimensions(dimensions)
    svc.check_prompt(prompt_name)
    mode = svc.long_mode(field("truncation_direction") or "right", field("truncate"), asked, overlap)
    if mode == "chunk" and not rule.chunks:
        if asked == "chunk" or overlap is not None:
            name = "long_inputs" if asked == "chunk" else "chunk_overlap"
            raise HTTPError(422, f"{name}: /{route} on this model cannot pool a chunked text's rows into one, so it "
                                 "does not chunk; send truncate=true (or leave the field out: a long input is refused)",
                            "Validation", param=name)
        mode = "refuse"  # the server chunks, this route cannot: a long input is a 413, not cut without a word
    if mode == "chunk" and overlap is not None:
        try:
            check_overlap(svc.model, overlap, prompt_name)
        except ValueError as e:
            raise HTTPError(422, str(e), "Validation", param="chunk_overlap") from None
    return Fields(mode, prompt_name, dimensions, overlap)
