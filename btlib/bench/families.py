"""Every model family btlib loads, packed against transformers on the workbook's corpus: ``family_speed``.

x = family: bert, roberta, xlm-roberta, distilbert, camembert, electra, mpnet, modernbert, nomic_bert, gte, qwen3. For each,
transformers writes a random-weight folder into a temporary directory, at the shape of its config class's defaults, which are
the family's base checkpoint: bert-base, roberta-base, xlm-roberta-base, camembert-base (12 x 768, FFN 3072), distilbert-base
(6 x 768), mpnet-base (12 x 768, FFN 3072, 32 relative-position buckets added to every score: no FLOP counted
for them), electra-small-discriminator (12 x 256, FFN 1024, embeddings 128 projected up), ModernBERT-base (22 x 768,
GeGLU 1152, window 128 on 2 layers of 3), nomic-embed-text-v1.5 (12 x 768, SwiGLU 3072), gte-multilingual-base
(12 x 768, GeGLU 3072), and Qwen3 at Qwen3-Embedding-0.6B's shape, not Qwen3Config's defaults (Qwen3-8B's): 28 x
1024, 16 query heads and 8 key / value heads of 128, SwiGLU 3072, causal. Two changes to every folder: vocab_size 30522
and the workbook's tokenizer (all-MiniLM-L6-v2's WordPiece, [PAD] = 0, pad_token_id 0), so that every family reads the
same token ids; the vocabulary sizes only the embedding table, no encoder FLOP. Weights are transformers' own
initialisation (random: fine for speed; parity on weights that stress every term is tests/test_families.py's,
test_modernbert.py's, test_rotary_bert.py's and test_qwen3.py's).
Quick sizes: the same families at d 64, 2 layers (ModernBERT 3: one global, two local; Qwen3 4 heads, 2 key / value
heads of 16).

Both providers compute the same thing, the last hidden states of every real token, on the workbook's sentences (file
order, ``repeat`` times) tokenized once, in batches of ``batch_size`` (32) in arrival order; tokenizing and pooling are
left out of both:

    transformers   AutoModel.from_pretrained(folder) (its default attention: sdpa, except MPNet, which transformers 5.23 runs eager only), each batch
                   right-padded to its longest text with its attention mask, inference_mode (the reference)
    packed         btlib.load_pretrained(folder): the same batches packed (ids + cu_seqlens), no padding anywhere

Checked before timing: max |packed - transformers| over the real tokens relative to transformers' max |value|, <= 1e-5,
the fp32 bound btlib.pretrained.coverage holds every family to.

Every row carries the FLOP prediction (``predicted``: encoder FLOPs padded / packed, :func:`predict`), notebook 07's
formula per layer: linear layers 8 d^2 + 4 d d_ff per token, attention 4 d per (query, key) pair. Where it differs:
a GLU FFN (ModernBERT, NomicBERT, GTE, Qwen3) has three d x d_ff matrices, 8 d^2 + 6 d d_ff; ModernBERT's local layers
count, packed, only the pairs inside the window (btlib skips the rest), padded all T^2 (transformers' window is a dense
mask). Qwen3's attention is H Dh wide with Hkv Dh-wide keys and values: 2 d (H + 2 Hkv) Dh + 2 d H Dh for q, k, v, o, and
4 H Dh per pair; causal, so packed counts the pairs j <= i (btlib's kernel skips the tiles above the diagonal), padded
all T^2 (transformers' causal and padding mask is one dense mask).
Not counted, on either side: embeddings, ELECTRA's projection (2 x 128 x 256 per token, < 1% of its layers), the
pooler that transformers' BERT-style models run on each [CLS] (B d^2 per batch).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kernels import relative_error
from ..lengths import encoder_flops
from . import pretrained as workbook
from .core import Benchmark, Provider, declare
from .verdict import compare

__all__ = ["FAMILY_NAMES", "Shape", "shape_of", "predict", "family_pair", "summary", "check"]

FAMILY_NAMES = ("bert", "roberta", "xlm-roberta", "distilbert", "camembert", "electra", "mpnet", "modernbert", "nomic_bert",
                "gte", "qwen3")
GLU = ("modernbert", "nomic_bert", "gte", "qwen3")  # their FFN: up and gate (d -> d_ff each), then down
VOCAB = 30522  # the workbook tokenizer's (all-MiniLM-L6-v2, BERT uncased WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
TOL = 1e-5  # btlib.pretrained.coverage's fp32 bound, the same for every family (tests/test_bench_families.py holds it)

# over each config class's defaults: "base" changes only the vocabulary and the ids; "tiny" shrinks the shape too
_IDS = {"vocab_size": VOCAB, "pad_token_id": 0}
_MODERNBERT_IDS = {"bos_token_id": 101, "cls_token_id": 101, "eos_token_id": 102, "sep_token_id": 102}  # [CLS], [SEP]
_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
_TINY_OF = {"distilbert": {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128},
            "electra": {**_TINY, "embedding_size": 32},  # keeps the projection
            "modernbert": {**_TINY, "num_hidden_layers": 3, "intermediate_size": 96},
            "qwen3": {**_TINY, "num_key_value_heads": 2, "head_dim": 16}}
_BASE_OF = {"qwen3": {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
                      "head_dim": 128, "intermediate_size": 3072}}  # Qwen3-Embedding-0.6B's config.json


def _config(family: str, size: str):
    """transformers' config of ``family`` at ``size`` ("base": the class defaults, the base checkpoint's shape)."""
    import transformers as tf

    cls = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "xlm-roberta": tf.XLMRobertaConfig,
           "distilbert": tf.DistilBertConfig, "camembert": tf.CamembertConfig, "electra": tf.ElectraConfig,
           "mpnet": tf.MPNetConfig, "modernbert": tf.ModernBertConfig, "nomic_bert": tf.NomicBertConfig, "gte": tf.GteConfig,
           "qwen3": tf.Qwen3Config}[family]
    if size not in ("base", "tiny"):
        raise ValueError(f"size must be 'base' or 'tiny'; got {size!r}")
    extra = _TINY_OF.get(family, _TINY) if size == "tiny" else _BASE_OF.get(family, {})
    return cls(**_IDS, **(_MODERNBERT_IDS if family == "modernbert" else {}), **extra)


@dataclass(frozen=True)
class Shape:
    """What the FLOP count needs: layers, d, d_ff, a GLU FFN or not, ModernBERT's sliding window
    (half-widths, on ``local_layers`` of the ``layers``; None: every layer global), and for a decoder (Qwen3) the
    attention's width H Dh and the keys' and values' Hkv Dh (None: d, as in BERT) and its causal mask."""

    layers: int
    d: int
    d_ff: int
    glu: bool = False
    window: tuple[int, int] | None = None
    local_layers: int = 0
    attn: int | None = None
    kv: int | None = None
    causal: bool = False

    def __str__(self) -> str:
        local = f", window {sum(self.window)} on {self.local_layers}" if self.window else ""
        gqa = f", attention {self.attn} (k, v {self.kv})" if self.attn is not None else ""
        causal = ", causal" if self.causal else ""
        return f"{self.layers} x {self.d}{gqa}{causal}, {'GLU ' if self.glu else ''}FFN {self.d_ff}{local}"


def shape_of(config) -> Shape:
    """The :class:`Shape` of a transformers config of one of :data:`FAMILY_NAMES`."""
    if config.model_type == "distilbert":
        return Shape(config.n_layers, config.dim, config.hidden_dim)
    window, local = None, 0
    if config.model_type == "modernbert":
        window = (config.local_attention // 2,) * 2
        local = sum(t == "sliding_attention" for t in config.layer_types)
    if config.model_type == "qwen3":
        return Shape(config.num_hidden_layers, config.hidden_size, config.intermediate_size, True,
                     attn=config.num_attention_heads * config.head_dim,
                     kv=config.num_key_value_heads * config.head_dim, causal=True)
    return Shape(config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.model_type in GLU,
                 window, local)


def predict(lengths: torch.Tensor, batch_size: int, shape: Shape) -> dict:
    """Encoder FLOPs of ``lengths`` (N,) batched by ``batch_size`` in arrival order, each batch padded to its longest,
    against the same texts packed: {"padded", "packed" (FLOPs), "token_ratio", "speedup" (padded / packed)}, both by
    btlib.lengths.encoder_flops; padded, a window saves nothing (transformers' window is a dense mask).

    Example: lengths [2, 4, 3], batch 2 -> batches [2, 4] padded to 4 and [3]: 11 token slots for 9 tokens
    (token_ratio 1.22), attention pairs 2 x 16 + 9 = 41 for 4 + 16 + 9 = 29.
    """
    padded_lengths = torch.cat([torch.full((len(b),), int(b.max())) for b in lengths.long().split(batch_size)])
    common = dict(d_model=shape.d, d_ff=shape.d_ff, num_layers=shape.layers, glu=shape.glu, attn_width=shape.attn,
                  kv_width=shape.kv)
    packed = encoder_flops(lengths, **common, window=shape.window, local_layers=shape.local_layers, causal=shape.causal)
    padded = encoder_flops(padded_lengths, **common)  # every (query, key) pair of the padded batch: a dense mask
    return {"padded": padded, "packed": packed, "token_ratio": int(padded_lengths.sum()) / int(lengths.sum()),
            "speedup": padded / packed}


@dataclass
class FamilyPair:
    """transformers' AutoModel and btlib's model of one folder (the same weights), its shape and attention."""

    family: str
    hf: Any
    ours: Any
    shape: Shape
    attn: str


@functools.lru_cache(maxsize=1)  # one family in memory at a time: the x loop builds each once per run
def family_pair(family: str, size: str = "base", seed: int = 0) -> FamilyPair:
    """transformers writes ``family``'s random-weight folder (seeded, in a temporary directory, with the workbook's
    tokenizer); AutoModel.from_pretrained and btlib.load_pretrained both read it back: the same file, bit for bit."""
    import transformers as tf

    from ..pretrained import default_model_folder, load_pretrained

    if family not in FAMILY_NAMES:
        raise ValueError(f"family must be one of {FAMILY_NAMES}; got {family!r}")
    config = _config(family, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.AutoModel.from_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        for name in TOKENIZER_FILES:
            shutil.copy(default_model_folder() / name, Path(tmp) / name)
        hf = tf.AutoModel.from_pretrained(tmp).eval()
        ours = load_pretrained(tmp).eval()
    return FamilyPair(family, hf, ours, shape_of(hf.config), str(hf.config._attn_implementation))


def _why_not() -> str | None:
    """Why this benchmark cannot run here (transformers or the workbook's tokenizer missing), or None."""
    from ..pretrained.reference import transformers_available

    return workbook._available() or transformers_available()


@functools.lru_cache(maxsize=4)
def _ids(key: tuple) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(s) for s in workbook._model().tokenize(workbook.texts(dict(key))))


def _token_ids(p: dict) -> tuple[tuple[int, ...], ...]:
    """The corpus of point ``p``, tokenized once by the workbook's tokenizer (all-MiniLM-L6-v2's, 256 tokens at most)."""
    return _ids(tuple(sorted((k, p[k]) for k in ("corpus", "repeat", "draws", "passages", "seed") if k in p)))


def _inputs(p: dict) -> dict:
    why = _why_not()
    if why:
        return {"why": why}
    from ..pretrained.encoding import pack_ids

    pair = family_pair(p["family"], p["size"])
    ids = [list(s) for s in _token_ids(p)]
    B = p["batch_size"]
    padded, packed = [], []
    for i in range(0, len(ids), B):
        batch = ids[i:i + B]
        T = max(map(len, batch))
        mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in batch])  # (B, T), 1 at real tokens
        padded.append((torch.tensor([s + [0] * (T - len(s)) for s in batch]), mask))  # (B, T) int64, [PAD] = 0
        packed.append(pack_ids(batch))  # ids (total,), cu_seqlens (B + 1,)
    lengths = torch.tensor([len(s) for s in ids])
    return {"pair": pair, "padded": padded, "packed": packed, "prediction": predict(lengths, B, pair.shape)}


def _transformers(x: dict) -> list[torch.Tensor]:
    hf = x["pair"].hf
    with torch.inference_mode():
        return [hf(input_ids=ids, attention_mask=mask).last_hidden_state for ids, mask in x["padded"]]  # (B, T, d) each


def _packed(x: dict) -> list[torch.Tensor]:
    ours = x["pair"].ours
    with torch.inference_mode():  # the forward encode() runs on each batch (SentenceEncoder's hook), fp32
        return [ours._forward_packed(tokens, ours.runner("fp32")) for tokens in x["packed"]]  # (total_b, d) each


def _real(out: list[torch.Tensor], x: dict) -> torch.Tensor:
    """Either provider's output as the real tokens' states (total, d), in corpus order."""
    if out[0].dim() == 3:
        return torch.cat([h[mask.bool()] for h, (_, mask) in zip(out, x["padded"])])
    return torch.cat(out)


def _reference(x: dict) -> torch.Tensor | None:
    return None if "why" in x else _real(_transformers(x), x)


def _metrics(out: Any, ref: torch.Tensor, x: dict) -> dict:
    pr = x["prediction"]
    return {"predicted": pr["speedup"], "token_ratio": pr["token_ratio"], "shape": str(x["pair"].shape),
            "attn": x["pair"].attn}


def _flops(p: dict) -> float | None:
    """Useful FLOPs: the packed count (real tokens only), so both rows' GFLOP/s are rates of the same work."""
    if _why_not():
        return None
    lengths = torch.tensor([len(s) for s in _token_ids(p)])
    return predict(lengths, p["batch_size"], family_pair(p["family"], p["size"]).shape)["packed"]


def summary(rows: list[dict]) -> str:
    """One line per family: shape, both times, the measured factor with its noise, the FLOP prediction, >= 2x or not."""
    head = ["family", "shape", "transformers ms", "packed ms", "packed vs transformers", "predicted", ">= 2x", "error"]
    lines = []
    for fam in dict.fromkeys(r["x"] for r in rows):
        by = {r["provider"]: r for r in rows if r["x"] == fam}
        hf, pk = by.get("transformers"), by.get("packed")
        if not (hf and pk and hf["status"] == pk["status"] == "ok"):
            why = next((f"{r['provider']} {r['status']}: {r.get('reason')}" for r in (hf, pk) if r and r["status"] != "ok"),
                       "not run")
            lines.append([fam, "-", "-", "-", why, "-", "-", "-"])
            continue
        ratio = hf["median_ms"] / pk["median_ms"]
        lines.append([fam, pk["shape"], f"{hf['median_ms']:.0f}", f"{pk['median_ms']:.0f}", str(compare(pk, hf)),
                      f"{pk['predicted']:.2f}x", "yes" if ratio >= 2 else "NO", f"{pk['error']:.1e}"])
    widths = [max(len(c) for c in col) for col in zip(head, *lines)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*line) for line in lines)]
    return "\n".join(line.rstrip() for line in out)


def check(families: tuple[str, ...] = FAMILY_NAMES, size: str = "tiny") -> str:
    """The benchmark's check alone, untimed: per family at ``size``, btlib's packed token states against transformers'
    on the workbook's corpus, relative to transformers' largest value, against TOL (notebook 07 at its default sizes)."""
    if why := _why_not():
        return f"not checked here: {why}"
    lines = []
    for fam in families:
        x = _inputs({**BENCH.params, "family": fam, "size": size})
        err = relative_error(_real(_packed(x), x), _reference(x))
        lines.append(f"{fam:12s} max |packed - transformers| / max |transformers| {err:.1e} <= {TOL:.0e}: {err <= TOL}  "
                     f"({x['pair'].shape})")
    return "\n".join(lines)


BENCH = declare(Benchmark(
    name="family_speed",
    description="every family btlib loads (random weights, base shapes): btlib packed vs transformers padded, last hidden "
                "states of the workbook's corpus at batch 32, beside the FLOP prediction",
    x_name="family", x_vals=FAMILY_NAMES,
    providers=lambda: [
        Provider("transformers", _transformers, available=_why_not, label="transformers AutoModel, padded per batch, its default attention"),
        Provider("packed", _packed, available=_why_not, label="btlib.load_pretrained, packed, no padding"),
    ],
    make_inputs=_inputs,
    reference=_reference,
    error=lambda out, ref, x: relative_error(_real(out, x), ref),
    metrics=_metrics,
    tol=TOL,
    params={"size": "base", "batch_size": 32, "corpus": "file", "repeat": 1, "draws": 512, "passages": 64, "seed": 0},
    quick={"size": "tiny"},
    flops=_flops,
    baseline="transformers",
    summary=summary,
))
