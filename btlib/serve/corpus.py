"""Embedding a corpus: its rows read one way, batches by a token budget, and a callable class for Ray Data's ``map_batches``.

Rows of a file (:func:`iter_texts`, :func:`count_rows`; what ``python -m btlib.embed`` reads): Parquet by its
column; plain text (``.txt`` or any other suffix) and JSON lines (``.jsonl``) by one rule, read in binary and
decoded per line as strict UTF-8, so counting and reading cannot disagree:

- a row ends at b"\\n" (the last one may end at the end of the file instead; an empty file has no rows);
- one "\\r" before it is dropped (a CRLF file); a lone "\\r", U+2028, U+0085, \\x0b or \\x0c inside a row is text;
- a UTF-8 BOM at the very start of the file is dropped, as Python's ``utf-8-sig`` does (elsewhere U+FEFF is text);
- in a text file every line is a row, empty ones included; in JSON lines each line is one object and a blank
  line is an error.

Every input error names the file and the line (1-based; Parquet: the row, 0-based) and says what to do.

    ds = ray.data.read_parquet("corpus/")                       # a column "text"
    ds = ds.map_batches(CorpusEmbedder, compute=ray.data.ActorPoolStrategy(size=2), batch_size=256)  # adds "embedding"
    ds.write_parquet("embedded/")

Ray Data runs ``size`` copies of the class (actors; ``concurrency=2`` before Ray 2.51, still accepted
with a warning), each loading the model once, and streams batches of rows through them; on a cluster
(``ray start --head`` on one machine, ``ray start --address=HEAD:6379`` on the others) the same code
spreads the actors over the machines.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

import torch
from torch import Tensor

from ..precision import ENCODE_PRECISIONS, check_precision
from ..pretrained.encoding import check_text, check_texts
from .extras import require

__all__ = ["encode_by_tokens", "CorpusEmbedder", "ray_embed_parquet", "iter_texts", "count_rows", "file_format"]

BOM = b"\xef\xbb\xbf"


def file_format(path: Path) -> str:
    """"parquet", "jsonl" or "text", from the suffix."""
    return {".parquet": "parquet", ".jsonl": "jsonl"}.get(path.suffix.lower(), "text")


def _lines(f: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """(byte offset, row) for each row of a binary file, by the module's one rule: what both counting and reading use."""
    offset = 0
    for n, raw in enumerate(f):  # a binary file splits at b"\n" only: text mode's universal newlines split at "\r" too
        line = raw.removeprefix(BOM) if n == 0 else raw
        if not line and raw:  # the file is a BOM alone
            return
        start = offset + len(raw) - len(line)
        offset += len(raw)
        line = line.removesuffix(b"\n")
        yield start, line.removesuffix(b"\r")


def count_rows(path: str | Path, column: str = "text") -> int:
    """Rows in ``path`` (Parquet from its footer; other formats by :func:`_lines`, the rule reading follows)."""
    path = Path(path)
    if file_format(path) == "parquet":
        return require("pyarrow.parquet", "scale").ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        return sum(1 for _ in _lines(f))


def iter_texts(path: str | Path, column: str = "text", chunk: int = 1024) -> Iterator[list[str]]:
    """The texts of ``path`` in order, ``chunk`` at a time (the last chunk may be shorter), each checked: ValueError or
    TypeError naming the file and line (Parquet: row) of the first that is not a Unicode str, and what to do."""
    path = Path(path)
    rows = _parquet_rows(path, column) if file_format(path) == "parquet" else _text_rows(path, column)
    while batch := list(itertools.islice(rows, chunk)):
        yield batch


def _parquet_rows(path: Path, column: str) -> Iterator[str]:
    pf = require("pyarrow.parquet", "scale").ParquetFile(path)
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path.name} has no column {column!r} (columns: {pf.schema_arrow.names}); pass --column")
    texts = (t for b in pf.iter_batches(batch_size=1024, columns=[column]) for t in b.column(0).to_pylist())
    for i, text in enumerate(texts):
        yield _checked(text, column, f"{path.name} row {i} (0-based)")


def _text_rows(path: Path, column: str) -> Iterator[str]:
    jsonl = file_format(path) == "jsonl"
    with open(path, "rb") as f:
        for n, (offset, line) in enumerate(_lines(f), 1):
            where = f"{path.name} line {n}"
            if jsonl and not line.strip():
                raise ValueError(f"{where} is blank: JSON lines hold one object per line; delete the line "
                                 "(in a text file an empty line is an empty text)")
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:  # a ValueError whose message names neither file nor line
                raise ValueError(f"{where} is not UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start} of the line, "
                                 f"{offset + e.start} of the file, counting from 0): re-encode the file as UTF-8, or "
                                 "decode it with errors='replace' and write it back") from None
            if not jsonl:
                yield text
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:  # its "line 1 column 1" counts within the row
                raise ValueError(f"{where} is not JSON ({e.msg} at column {e.colno}): fix or delete the line") from None
            if not isinstance(row, dict) or column not in row:
                raise ValueError(f"{where}: expected an object with {column!r}; pass --column to name the field")
            yield _checked(row[column], column, where)


def _checked(text: object, column: str, where: str) -> str:
    if not isinstance(text, str):
        raise TypeError(f"{where}: {column!r} is {type(text).__name__}, not str; make it a string or drop the row")
    check_text(text, where)  # a JSON "\ud800" escape: a str, not Unicode text, which the tokenizer would refuse
    return text


def encode_by_tokens(model, texts: Sequence[str], *, max_batch_tokens: int = 8192, precision: str | None = None) -> Tensor:
    """``model.encode(texts)`` run in length-sorted batches of at most ``max_batch_tokens`` tokens: (N, d) float32, in input order.

    Sorting groups texts of similar length, so a batch's cost (and its attention's ``max_seqlen``) stays
    even; a text longer than the budget runs alone. The same texts always form the same batches, so
    the result is deterministic (a resumed corpus job writes the same bits).
    """
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens <= 0:
        raise ValueError(f"max_batch_tokens must be a positive int; got {max_batch_tokens!r}")
    texts = list(texts)
    check_texts(texts)  # before tokenizing: the Rust tokenizer answers a lone surrogate with a TypeError about its input type
    if not texts:
        return model.encode([], batch_size=1, precision=precision)
    # the tokens each text costs as encode runs it, the folder's default prompt included (model.tokenize leaves it out,
    # so a prompted model's batches ran past the budget by the prompt's tokens per text)
    lengths = [len(e.ids) for e in model.encodings(texts)] if hasattr(model, "encodings") else \
        [len(ids) for ids in model.tokenize(texts)]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])
    groups, group, used = [], [], 0
    for i in order:
        if group and used + lengths[i] > max_batch_tokens:
            groups.append(group)
            group, used = [], 0
        group.append(i)
        used += lengths[i]
    groups.append(group)
    parts = [model.encode([texts[i] for i in g], batch_size=len(g), precision=precision) for g in groups]
    out = torch.empty(len(texts), parts[0].shape[1])
    out[torch.tensor([i for g in groups for i in g])] = torch.cat(parts)
    return out


class CorpusEmbedder:
    """Ray Data UDF: a batch with a text column in, the same batch with an embedding column out.

    folder: a model folder (None: all-MiniLM-L6-v2, as :func:`btlib.load_pretrained`). text_column /
    embedding_column: column names. precision, max_batch_tokens: as :func:`encode_by_tokens`.
    A batch is a dict of numpy arrays (Ray's default batch format) or a pandas DataFrame; the
    embedding column is a (n, d) float32 array (a list of (d,) arrays in a DataFrame).
    """

    def __init__(self, folder: str | Path | None = None, *, text_column: str = "text", embedding_column: str = "embedding",
                 precision: str | None = None, max_batch_tokens: int = 8192):
        from ..pretrained import load_pretrained

        check_precision(precision, ENCODE_PRECISIONS)  # before loading the model: a typo costs nothing
        self.model = load_pretrained(folder)
        self.text_column, self.embedding_column = text_column, embedding_column
        self.precision, self.max_batch_tokens = precision, max_batch_tokens

    def __call__(self, batch: Any) -> Any:
        if self.text_column not in batch:
            raise ValueError(f"the batch has no column {self.text_column!r} (columns: {list(batch.keys())}); "
                             f"pass text_column= to CorpusEmbedder")
        texts = list(batch[self.text_column])
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"column {self.text_column!r} row {bad} is {type(texts[bad]).__name__}, not str")
        emb = encode_by_tokens(self.model, texts, max_batch_tokens=self.max_batch_tokens, precision=self.precision).numpy()
        if hasattr(batch, "assign"):  # a pandas DataFrame
            return batch.assign(**{self.embedding_column: list(emb)})
        return {**batch, self.embedding_column: emb}


def ray_embed_parquet(source: str | Path, dest: str | Path, *, concurrency: int = 1, batch_size: int = 256,
                      **embedder_kwargs) -> int:
    """Read Parquet ``source`` with Ray Data, add embeddings with ``concurrency`` :class:`CorpusEmbedder` actors, write ``dest``.

    Joins the running Ray cluster (or starts a local one, as ``ray.data`` does). Returns the rows written.
    Needs the ``scale`` extra (ray, pyarrow).
    """
    ray = require("ray", "scale")
    ds = ray.data.read_parquet(str(source))
    # Ray Data hands one block to one actor: a corpus in one file is one block, which left all but one actor idle
    # (measured on 2 cores, 2 actors, 4096 texts: 93 texts/s steady, what one 1-thread actor does). A few blocks
    # per actor, each still many batches, keep every actor busy to the end.
    ds = ds.repartition(max(4 * concurrency, 1))
    pool = ray.data.ActorPoolStrategy(size=concurrency)  # Ray >= 2.51's spelling of concurrency=N for a class
    ds = ds.map_batches(CorpusEmbedder, fn_constructor_kwargs=embedder_kwargs, compute=pool, batch_size=batch_size)
    ds = ds.materialize()
    ds.write_parquet(str(dest))
    return ds.count()
