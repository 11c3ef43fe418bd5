"""The folders and servers tests/fuzz_serve.py sends its cases to: tiny random-weight folders (hidden 32, the cased
word-level tokenizer of tests/st_folders.py, so "w3" is one token and a text costs its words plus [CLS] and [SEP]),
one in-process server each on loopback, and each server's oracle (sentence-transformers loaded from the same folder).

    name            folder                                                      server (max_inputs 6)
    prompted        mean, Normalize, max_seq_length 12, prompts query "w1 w2 "   max_batch_tokens 32
                    (default) and passage "W3 "
    no_prompt_pool  include_prompt false, no Normalize, max_seq_length 12,       --auto-truncate, 48
                    the same prompts
    dense           Dense 32 -> 8 (tanh), no Normalize, max_seq_length 10, a     16
                    named prompt and no default
    truncate_dim    CLS pooling, Normalize, truncate_dim 16, max_seq_length 16   32
    reranker        BertForSequenceClassification, one label, 24 tokens a pair   --auto-truncate, 48
    chunking        mean, Dense 32 -> 16 (tanh), Normalize, max_seq_length 12,   --long-inputs chunk, 24,
                    the prompted folder's prompts                                max_request_tokens 160
    chunking_cls    the truncate_dim folder                                      --long-inputs chunk, 32, 200
    chunking_noprompt  the no_prompt_pool folder                                 --long-inputs chunk, 24, 160
    splade          SparseEncoder (MLMTransformer, SpladePooling max relu),      32
                    max_seq_length 16

The budgets are small so that requests and bursts run in slices (btlib.serve.slices): the chunking server's
budget holds two chunks, so a long text's chunks run over several forwards beside other requests.

    with campaign(Path(tmp)) as targets: ...   # a list of serve_oracle.Target, servers running
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch

from serve_oracle import Target

PROMPTS = {"query": "w1 w2 ", "passage": "W3 "}  # 2 and 1 tokens
MAX_INPUTS = 6


def _edit(path: Path, **fields) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def write_folders(work: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (folder, server options: create_app's and BatchEncoder's)."""
    import transformers as tf
    from st_folders import write_hf, write_st
    from test_sparse import write_splade

    base = write_hf(work / "hf", "bert")
    out = {
        "prompted": (write_st(work / "prompted", base, normalize=True, max_seq_length=12, prompts=PROMPTS,
                              default_prompt_name="query"), {"max_batch_tokens": 32}),
        "no_prompt_pool": (write_st(work / "no_prompt_pool", base, include_prompt=False, max_seq_length=12,
                                    prompts=PROMPTS, default_prompt_name="query"),
                           {"auto_truncate": True, "max_batch_tokens": 48}),
        "dense": (write_st(work / "dense", base, dense=[(8, True, torch.nn.Tanh())], max_seq_length=10,
                           prompts={"passage": "W5 W6 W7 "}), {"max_batch_tokens": 16}),
        "truncate_dim": (write_st(work / "truncate_dim", base, pooling="cls", normalize=True, max_seq_length=16),
                         {"max_batch_tokens": 32}),
        "chunking": (write_st(work / "chunking", base, dense=[(16, True, torch.nn.Tanh())], normalize=True,
                              max_seq_length=12, prompts=PROMPTS, default_prompt_name="query"),
                     {"long_inputs": "chunk", "max_batch_tokens": 24, "max_request_tokens": 160}),
    }
    _edit(out["truncate_dim"][0] / "config_sentence_transformers.json", truncate_dim=16)
    # tokenizer.json is the tokenizer: a tokenizer_class (BertTokenizer) would have transformers 5 rebuild BERT's
    # pre-tokenizer, which splits "<pad>" or "東京" where tokenizer.json's WhitespaceSplit does not (btlib and TEI
    # read tokenizer.json); model_input_names hands the pair's token types to the model
    ce = write_hf(work / "reranker", "bert", model_cls=tf.BertForSequenceClassification, num_labels=1)
    _edit(ce / "tokenizer_config.json", model_max_length=24,
          model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    out["reranker"] = (ce, {"auto_truncate": True, "max_batch_tokens": 48})
    # the chunk path under other heads: CLS pooling with truncate_dim after the Normalize; include_prompt false (each
    # chunk's [CLS] and prompt left out of its mean, as encode's prompt_length does), no Normalize
    out["chunking_cls"] = (out["truncate_dim"][0], {"long_inputs": "chunk", "max_batch_tokens": 32, "max_request_tokens": 200})
    out["chunking_noprompt"] = (out["no_prompt_pool"][0], {"long_inputs": "chunk", "max_batch_tokens": 24,
                                                           "max_request_tokens": 160})
    splade = write_splade(work / "splade")
    _edit(splade / "sentence_bert_config.json", max_seq_length=16)
    out["splade"] = (splade, {"max_batch_tokens": 32})
    return out


def _target(name: str, folder: Path, options: dict) -> tuple[Target, object]:
    """(the target, without its url; the btlib model to serve)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder

    from btlib import load_pretrained, load_reranker
    from btlib.pretrained.sparse import load_sparse
    from btlib.serve.rerank import PairScorer

    common = dict(url="", max_inputs=MAX_INPUTS, auto_truncate=options.get("auto_truncate", False),
                  long_inputs=options.get("long_inputs", ""), budget=options["max_batch_tokens"],
                  max_request_tokens=options.get("max_request_tokens"))
    if name == "reranker":
        ref = CrossEncoder(str(folder), device="cpu")
        return Target(name, "reranker", ref, max_len=ref.tokenizer.model_max_length, **common), PairScorer(load_reranker(folder))
    if name == "splade":
        ref = SparseEncoder(str(folder), device="cpu")
        return (Target(name, "sparse", ref, max_len=ref.max_seq_length, prompts=dict(ref.prompts),
                       default_prompt=ref.default_prompt_name, **common), load_sparse(folder))
    ref = SentenceTransformer(str(folder), device="cpu")
    return (Target(name, "embedding", ref, max_len=ref.max_seq_length, width=ref.get_embedding_dimension(),
                   normalizes=any(type(m).__name__ == "Normalize" for m in ref), prompts=dict(ref.prompts),
                   default_prompt=ref.default_prompt_name, **common), load_pretrained(folder))


@contextlib.contextmanager
def campaign(work: Path, only: list[str] | None = None):
    """Write the folders under ``work``, start one server per folder (``only``: these); yields the Target list."""
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app, start_server

    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    targets, servers = [], []
    try:
        for name, (folder, options) in write_folders(work).items():
            if only is not None and name not in only:
                continue
            t, model = _target(name, folder, options)
            batcher = BatchEncoder(model, max_wait_ms=1, max_batch_tokens=options["max_batch_tokens"],
                                   max_request_tokens=options.get("max_request_tokens"))
            app_options = {k: options[k] for k in ("auto_truncate", "long_inputs") if k in options}
            running = start_server(create_app(batcher, max_inputs=MAX_INPUTS, **app_options))
            servers.append(running)
            t.url = running.url
            targets.append(t)
        yield targets
    finally:
        for running in servers:
            running.stop()
