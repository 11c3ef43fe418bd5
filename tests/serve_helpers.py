"""Test helpers for btlib.serve's HTTP app: one running server per module, and a client for it."""

from __future__ import annotations

import contextlib
from typing import Iterator


@contextlib.contextmanager
def running_app(model, **app_options) -> Iterator[object]:
    """btlib.serve's app on a BatchEncoder of ``model`` (1 ms wait), on a free loopback port; on exit the server
    stops and the batcher must be closed (a graceful shutdown drains and closes it)."""
    from btlib.serve import BatchEncoder
    from btlib.serve.app import create_app, start_server

    batcher = BatchEncoder(model, max_wait_ms=1)
    running = start_server(create_app(batcher, **app_options))
    yield running
    running.stop()
    assert batcher.closed


@contextlib.contextmanager
def client_of(server) -> Iterator[object]:
    """An httpx client of a running server (60 s timeout)."""
    import httpx

    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def tiny_modernbert(max_length: int):
    """A random-weight ModernBERT (2 layers, hidden 32, window 8) with a word-level tokenizer over "w0" .. "w19",
    truncating at ``max_length``: any loaded encoder's stand-in for the batcher's tests."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from btlib.pretrained import ModernBertEncoder

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(20)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_truncation(max_length)
    config = dict(vocab_size=len(words), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=40,
                  global_attn_every_n_layers=2, local_attention=8, pad_token_id=0, bos_token_id=2, eos_token_id=3,
                  cls_token_id=2, sep_token_id=3, max_position_embeddings=64)
    return ModernBertEncoder.from_config(config, tok, max_length=max_length)


def run_line(threads: int, keep_warm_ms: float) -> str:
    """The serving probes' last line: the CPU and the settings that change their latencies (the packed batcher's
    keep-warm window, a process-wide GOMP_SPINCOUNT)."""
    import os

    import torch

    from btlib import hardware
    from btlib.cpu_generation import cpu_generation

    return (f"CPU: {hardware.cpu_name()} {cpu_generation()}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads, "
            f"packed keep_warm_ms={keep_warm_ms:g}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '(unset)')}")
