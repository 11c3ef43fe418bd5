"""The embedding routes' part of tests/serve_oracle.py: /embed, /v1/embeddings, /embed_all and /embed_sparse, what
each must answer from sentence-transformers and the rules alone (tests/st_rows.py builds the chunks by hand).

The long-input mode, from btlib/serve/service.py's and btlib/pretrained/chunking.py's docstrings:

    the body's long_inputs, else its truncate (true: "truncate", false: "refuse"), else the server's mode;
    422 naming long_inputs where truncate and long_inputs disagree, and for "chunk" on a server not started with
    long_inputs="chunk" (a body may ask for less than the server allows, never more); 422 naming chunk_overlap for one
    without "chunk", or outside 0 .. window - 1 (the window of the request's prompt) whether or not a text needs
    chunking. A route that cannot pool a text's chunks (/embed_all's token states; a SPLADE model's routes) runs the
    server's "chunk" as "refuse". Token-id inputs are never chunked: past max_seq_length they are a 413 unless the
    mode is "truncate".
    "refuse": 413 naming tokens for a text past max_seq_length with its prompt; "truncate": cut there; "chunk": the
    text's chunks (tests/st_rows.py) run and its row is their pooled row.
    max_request_tokens (a server's cap): 413 naming it for a request whose tokens, as they would run (chunks
    included), pass it. usage.prompt_tokens: those tokens; usage.chunks (btlib's) the sequences that ran, where the
    mode is "chunk".

/embed_all answers every input's token states ([CLS], prompt and [SEP] included; sentence-transformers'
output_value="token_embeddings"); /embed_sparse a SPLADE model's nonzero weights, [{"index", "value"}] by index
(SparseEncoder.encode); /embed on a SPLADE model its dense (vocab,) rows with normalize=false and 424 naming normalize
otherwise (TEI); dimensions on a SPLADE model's /embed is a 422. Any other model kind's route is a 424 naming the kind
the route needs (or "reranker" where a reranker is involved).
"""

from __future__ import annotations

import base64

import numpy as np
import torch

import st_rows
from serve_oracle import FIELDS, SERVES, Target, _id_rows, close, surrogate

__all__ = ["embedding_expect", "long_mode", "kind_refusal"]


def kind_refusal(t: Target, route: str) -> list[tuple]:
    """The 424 of a route whose model kind this server does not hold."""
    if t.kind in SERVES[route]:
        return []
    names = ("reranker",) if "reranker" in (t.kind, *SERVES[route]) else ("sparse", "SPLADE")
    return [((424,), names, f"/{route} on a {t.kind} model's server")]


def long_mode(t: Target, route: str, get, known: bool) -> tuple[str | None, int | None, list[tuple]]:
    """(the long-input mode, the request's chunk_overlap, the refusals) by the module docstring's rules; the mode is
    None where the rules refuse the fields."""
    fields = FIELDS[route]
    truncate = get("truncate") if "truncate" in fields else None
    asked = get("long_inputs") if "long_inputs" in fields else None
    overlap = get("chunk_overlap") if "chunk_overlap" in fields else None
    said = None if truncate is None else "truncate" if truncate else "refuse"
    if asked is not None and said is not None and asked != said:
        return None, overlap, [((422,), ("long_inputs",), f"truncate={truncate} and long_inputs={asked!r} disagree")]
    mode = asked or said or t.long_inputs
    if mode == "chunk" and t.long_inputs != "chunk":
        return None, overlap, [((422,), ("long_inputs",), f"chunk on a server started with {t.long_inputs!r}")]
    if overlap is not None and mode != "chunk":
        return None, overlap, [((422,), ("chunk_overlap",), f"chunk_overlap with long_inputs {mode!r}")]
    if mode == "chunk" and (route not in ("embed", "openai") or t.kind != "embedding"):
        mode = "refuse"  # a route that cannot pool chunks
    if mode == "chunk" and overlap is not None and known and not 0 <= overlap < st_rows.window(t, get("prompt_name")):
        return None, overlap, [((422,), ("chunk_overlap",), f"chunk_overlap={overlap} outside its window")]
    return mode, overlap, []


def _ran(t: Target, text: str, name, mode: str, overlap) -> int:
    """Tokens a text runs as in ``mode`` (chunk: all its chunks')."""
    if mode == "chunk":
        return sum(len(c) for c in st_rows.chunk_ids(t, text, name, overlap))
    return min(t.tokens(text, name), t.max_len) if mode == "truncate" else t.tokens(text, name)


def _cap(t: Target, tokens: int) -> list[tuple]:
    if t.max_request_tokens is not None and tokens > t.max_request_tokens:
        return [((413,), ("max_request_tokens",), f"{tokens} tokens > max_request_tokens {t.max_request_tokens}")]
    return []


def embedding_expect(t: Target, route: str, get) -> tuple[list[tuple], object, int, int]:
    """(refusals, the 200's checker, the tokens it runs, its texts of several chunks) for an embedding route's body
    (fields of the right types)."""
    key = "input" if route == "openai" else "inputs"
    value, name = get(key), get("prompt_name")
    texts = [value] if isinstance(value, str) else value
    out = kind_refusal(t, route)
    if route == "embed" and t.kind == "sparse" and get("normalize"):
        out.append(((424,), ("normalize",), "normalize=true on a SPLADE model (TEI)"))
    dims = get("dimensions") if "dimensions" in FIELDS[route] else None
    if dims is not None and (t.kind == "sparse" or not 1 <= dims <= (t.width or 32)):
        out.append(((422,), ("dimensions",), f"dimensions={dims} outside 1..{t.width} (none on SPLADE)"))
    if route != "openai" and get("truncation_direction").lower() != "right":
        out.append(((422,), ("truncation_direction",), "truncation_direction left"))
    known = name is None or name in t.prompts
    mode, overlap, refused = long_mode(t, route, get, known)
    out += refused
    if (rows := _id_rows(value)) is not None:
        out, tokens = _id_rules(t, get, key, rows, mode, out)
    else:
        if not texts:
            out.append(((422,), (key,), "no inputs"))
        if len(texts) > t.max_inputs:
            out.append(((413,), (key,), f"{len(texts)} inputs > max_inputs {t.max_inputs}"))
        if not known:
            out.append(((422,), ("prompt_name",), f"unknown prompt_name {name!r}"))
        out += [((422,), (key,), f"{key}[{i}] lone surrogate") for i, x in enumerate(texts) if surrogate(x)]
        tokens = 0
        if known and mode is not None and t.kind != "reranker":
            plain = [x for x in texts if not surrogate(x)]
            if mode == "refuse":
                out += [((413,), ("tokens",), f"{key}[{texts.index(x)}] past {t.max_len} tokens") for x in plain
                        if t.tokens(x, name) > t.max_len]
            tokens = sum(_ran(t, x, name, mode, overlap) for x in plain)
            out += _cap(t, tokens)
    several = sum(len(st_rows.chunk_ids(t, x, name, overlap)) > 1 for x in texts if not surrogate(x)) \
        if mode == "chunk" and rows is None and known else 0
    check = {"embed": _embed_answer, "openai": _openai_answer, "embed_all": _states_answer,
             "embed_sparse": _sparse_answer}[route](t, get, mode, overlap, tokens)
    return out, check, tokens, several


def _id_rules(t: Target, get, key: str, rows: list[list[int]], mode, out: list) -> tuple[list[tuple], int]:
    if get("prompt_name") is not None:
        out.append(((422,), ("prompt_name",), "prompt_name with token ids"))
    if len(rows) > t.max_inputs:
        out.append(((413,), (key,), f"{len(rows)} inputs > max_inputs {t.max_inputs}"))
    vocab = t.ref[0].auto_model.config.vocab_size if t.kind != "reranker" else None
    out += [((422,), (key,), f"{key}[{i}] empty or outside the vocabulary") for i, r in enumerate(rows)
            if not r or (vocab is not None and not all(0 <= x < vocab for x in r))]
    if mode is None or t.kind == "reranker":
        return out, 0
    if mode != "truncate":
        out += [((413,), ("tokens",), f"{key}[{i}] past {t.max_len} tokens (ids are never chunked)")
                for i, r in enumerate(rows) if len(r) > t.max_len]
    tokens = sum(min(len(r), t.max_len) for r in rows)
    return out + _cap(t, tokens), tokens


def reference(t: Target, texts, name, dims, normalize: bool, skip_normalize: bool = False, chunk: bool = False,
              overlap: int | None = None) -> torch.Tensor:
    """sentence-transformers' rows for texts (or token-id rows, run through its modules as given, cut at
    max_seq_length; or a chunked text's pooled row, ``chunk``), its truncate_dim, then ``dims`` features,
    L2-normalised where ``normalize``; skip_normalize: with its Normalize modules skipped (TEI's normalize=false).
    A SPLADE model: SparseEncoder's rows, dense."""
    rows, skip_normalize = _id_rows(texts), skip_normalize and t.normalizes  # a folder without Normalize: its own rows
    if t.kind == "sparse":
        return st_rows.sparse_rows(t, texts, name, rows)
    if chunk and rows is None:
        emb = torch.stack([st_rows.chunked_row(t, x, name, overlap, skip_normalize) for x in texts])
    elif rows is None and not skip_normalize:
        return t.ref.encode(texts, prompt_name=name, truncate_dim=dims, normalize_embeddings=normalize, convert_to_tensor=True)
    else:
        rows = rows if rows is not None else [t.ref.tokenize([t.prompt(name) + x])["input_ids"][0].tolist() for x in texts]
        emb = torch.stack([st_rows.run_modules(t, ids[:t.max_len], skip_normalize)["sentence_embedding"][0] for ids in rows])
    emb = emb[:, :t.ref.truncate_dim][:, :dims]
    return torch.nn.functional.normalize(emb, dim=-1) if normalize else emb


def _scale(t: Target, texts, name, dims, normalize: bool, skip_normalize: bool, chunk: bool, overlap) -> float | None:
    """The scale of rows cut to ``dims`` features and not renormalised: their full rows' (a first feature of 2e-3 is
    computed from states of order 1, with their rounding); None (the reference's own) otherwise."""
    if dims is None or normalize:
        return None
    return float(reference(t, texts, name, None, False, skip_normalize, chunk, overlap).abs().max())


def _embed_answer(t: Target, get, mode, overlap, tokens):
    texts = [get("inputs")] if isinstance(get("inputs"), str) else get("inputs")

    def check(answer) -> str | None:
        name, dims, normalize, chunk = get("prompt_name"), get("dimensions"), get("normalize"), mode == "chunk"
        ref = reference(t, texts, name, dims, normalize, not normalize, chunk, overlap)
        return close(answer, ref, _scale(t, texts, name, dims, normalize, not normalize, chunk, overlap))
    return check


def _openai_answer(t: Target, get, mode, overlap, tokens):
    texts = [get("input")] if isinstance(get("input"), str) else get("input")

    def check(answer) -> str | None:
        dims, name, chunk, unit = get("dimensions"), get("prompt_name"), mode == "chunk", get("dimensions") is not None and t.normalizes
        ref = reference(t, texts, name, dims, unit, False, chunk, overlap)
        try:
            data = answer["data"]
            if answer["object"] != "list" or [d["index"] for d in data] != list(range(len(texts))):
                return f"not OpenAI's list of embeddings in order: {str(answer)[:200]}"
            rows = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") if get("encoding_format") == "base64"
                    else d["embedding"] for d in data]
            usage = answer["usage"]
        except (KeyError, TypeError, ValueError) as e:
            return f"not OpenAI's answer ({type(e).__name__}: {e}): {str(answer)[:200]}"
        if (why := close(rows, ref, _scale(t, texts, name, dims, unit, False, chunk, overlap))) is not None:
            return why
        want = {"prompt_tokens": tokens, "total_tokens": tokens}
        if chunk:  # btlib's: the sequences that ran, where the mode is "chunk" (token ids: one each, never chunked)
            ids = _id_rows(get("input"))
            want["chunks"] = len(ids) if ids is not None else sum(len(st_rows.chunk_ids(t, x, name, overlap)) for x in texts)
        if usage != want:
            return f"usage {usage}, the tokens that ran (prompt and chunks included) are {want}"
        return None
    return check


def _states_answer(t: Target, get, mode, overlap, tokens):
    value = get("inputs")
    texts = [value] if isinstance(value, str) else value

    def check(answer) -> str | None:
        refs = st_rows.token_states(t, texts, get("prompt_name"), _id_rows(value))
        if not isinstance(answer, list) or len(answer) != len(refs):
            return f"not one list of token states per input: {str(answer)[:200]}"
        for i, (got, ref) in enumerate(zip(answer, refs)):
            if (why := close(got, ref)) is not None:
                return f"inputs[{i}]'s token states: {why}"
        return None
    return check


def _sparse_answer(t: Target, get, mode, overlap, tokens):
    value = get("inputs")
    texts = [value] if isinstance(value, str) else value

    def check(answer) -> str | None:
        ref = st_rows.sparse_rows(t, texts, get("prompt_name"), _id_rows(value))  # (N, vocab)
        got = torch.zeros_like(ref)
        try:
            if len(answer) != len(ref):
                return f"{len(answer)} rows for {len(ref)} inputs"
            for i, entries in enumerate(answer):
                index = [e["index"] for e in entries]
                if any(set(e) != {"index", "value"} for e in entries) or index != sorted(set(index)):
                    return f"row {i} is not [{{index, value}}] by increasing index: {str(entries)[:200]}"
                if any(not 0 <= j < ref.shape[1] or e["value"] == 0 for j, e in zip(index, entries)):
                    return f"row {i} has an index outside the vocabulary or a zero weight: {str(entries)[:200]}"
                got[i, index] = torch.tensor([float(e["value"]) for e in entries])
        except (KeyError, TypeError, ValueError, IndexError) as e:
            return f"not TEI's sparse rows ({type(e).__name__}: {e}): {str(answer)[:200]}"
        return close(got, ref)
    return check
