"""Serving and corpus scale: a packed dynamic batcher, an HTTP endpoint, Ray Data and a resumable corpus job.

    from btlib.serve import BatchEncoder, Overloaded       # in-process batching (no extra packages)
    python -m btlib.serve --port 8080                       # HTTP: TEI's API (/, /embed, /embed_all, ...) and OpenAI's
                                                            # /v1/embeddings, /v1/models (pip install -e .[serve])
    python -m btlib.serve --model CROSS_ENCODER_FOLDER      # HTTP: TEI /rerank, /predict, Cohere / Jina rerank bodies,
                                                            # through the same batcher (btlib.serve.rerank)
    ds.map_batches(CorpusEmbedder, compute=ray.data.ActorPoolStrategy(size=2))   # Ray Data (pip install -e .[scale])
    python -m btlib.embed corpus.parquet out/               # one machine, resumable shards

Only the batcher and the corpus helpers load here; the HTTP app (fastapi) loads with :func:`create_app`
(btlib.serve.app; its routes: btlib.serve.tei, btlib.serve.rerank_routes, btlib.serve.openai_routes).
"""

from __future__ import annotations

from .batcher import BatchEncoder, Encoder, InputTooLong, Overloaded
from .corpus import CorpusEmbedder, encode_by_tokens, ray_embed_parquet
from .extras import require
from .rerank import PairScorer
from .stats import BatcherStats, percentile, prometheus_text

__all__ = ["BatchEncoder", "Encoder", "InputTooLong", "Overloaded", "PairScorer", "CorpusEmbedder", "encode_by_tokens",
           "ray_embed_parquet",
           "BatcherStats", "percentile", "prometheus_text", "create_app", "require"]


def create_app(*args, **kwargs):
    """The FastAPI app (see :func:`btlib.serve.app.create_app`); needs the ``serve`` extra."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)
