"""Cross-encoders (rerankers): a *ForSequenceClassification folder scores (query, document) pairs, padding-free.

    reranker = btlib.load_reranker("path/to/ms-marco-MiniLM-L-6-v2")   # a local Hugging Face folder
    scores = reranker.predict([("what is packing?", "Packing drops the padding."), ...])  # (N,), as CrossEncoder
    reranker.rank("what is packing?", ["doc a", "doc b"], top_k=1)     # [(index, score)], best first

The encoder is the BERT family's :class:`~btlib.pretrained.architectures.bert.PretrainedEncoder` (load_bert: the same
spec, key mapping and checks), run on packed pairs: [CLS] q [SEP] d [SEP] (RoBERTa: <s> q </s></s> d </s>),
token types where the tokenizer hands them to the model, truncation longest-first to the tokenizer's
max length, as transformers' tokenizer(pairs, truncation=True). The head reads the first token of each
pair, h[cu_seqlens[:-1]] (B, d), with the tensors load_bert keeps aside, as transformers 5.23 does:

    architectures[0]                      first token ->                                 file keys
    BertForSequenceClassification         tanh(dense(x)), then classifier (the pooler)  bert.pooler.dense, classifier
    Roberta / XLMRoberta / Camembert...   tanh(dense(x)), then out_proj                  classifier.dense, .out_proj
    ElectraForSequenceClassification      gelu(dense(x)), then out_proj                  classifier.dense, .out_proj
    DistilBertForSequenceClassification   relu(dense(x)), then classifier                pre_classifier, classifier

``predict``'s activation follows sentence-transformers 6.2's CrossEncoder: by default the folder's
(config.json's ``sentence_transformers.activation_fn``, or the older ``sbert_ce_default_activation_function``),
else sigmoid for num_labels 1 and the logits themselves for more labels.

Not load_pretrained's job: load_pretrained on such a folder gives the encoder's pooled embeddings, as
SentenceTransformer(folder) does (it loads the encoder and drops the head).
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .bert import PretrainedEncoder, load_bert
from ..folders.checkpoint import ROBERTA_LAYOUT, CheckpointError, read_config
from ..encoding import Runner, Tokens, check_encode_args, check_text, pack_ids
from ..folders.st_folder import FolderPlan

__all__ = ["Reranker", "load_reranker", "HEADS", "ACTIVATIONS"]

# architectures[0] -> (model types it is written for, dense key, its activation, output key)
HEADS: dict[str, tuple[tuple[str, ...], str, str, str]] = {
    "BertForSequenceClassification": (("bert",), "bert.pooler.dense", "tanh", "classifier"),
    "RobertaForSequenceClassification": (ROBERTA_LAYOUT, "classifier.dense", "tanh", "classifier.out_proj"),
    "XLMRobertaForSequenceClassification": (ROBERTA_LAYOUT, "classifier.dense", "tanh", "classifier.out_proj"),
    "CamembertForSequenceClassification": (ROBERTA_LAYOUT, "classifier.dense", "tanh", "classifier.out_proj"),
    "ElectraForSequenceClassification": (("electra",), "classifier.dense", "gelu", "classifier.out_proj"),
    "DistilBertForSequenceClassification": (("distilbert",), "pre_classifier", "relu", "classifier"),
}
_FN = {"tanh": torch.tanh, "gelu": F.gelu, "relu": F.relu}  # gelu: exact (erf), transformers' get_activation("gelu")
ACTIVATIONS = ("identity", "sigmoid", "softmax", "tanh")  # predict's activation= besides None (the folder's default)
# the torch classes CrossEncoder's config names (config.json's sentence_transformers.activation_fn) btlib reproduces
_TORCH_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid", "torch.nn.modules.linear.Identity": "identity",
                      "torch.nn.modules.activation.Tanh": "tanh"}


class Reranker(nn.Module):
    """A PretrainedEncoder (``encoder``) and a sequence-classification head on the first token of each pair.

    dense, out: the head's two linear layers (d -> d, d -> num_labels); act: "tanh", "gelu" or "relu".
    default_activation: what ``predict(activation=None)`` applies (one of :data:`ACTIVATIONS`).
    id2label: label index -> name (config.json's; transformers' LABEL_i where it has none).
    """

    def __init__(self, encoder: PretrainedEncoder, dense: nn.Linear, act: str, out: nn.Linear, default_activation: str):
        super().__init__()
        self.encoder, self.dense, self.act, self.out = encoder, dense, act, out
        self.num_labels, self.default_activation = out.out_features, default_activation
        self.id2label = {i: f"LABEL_{i}" for i in range(self.num_labels)}  # transformers' default; the folder's in load
        self.eval()

    def logits(self, first: Tensor) -> Tensor:
        """First-token states (B, d) float32 -> logits (B, num_labels) float32."""
        return self.out(_FN[self.act](self.dense(first)))

    def predict(self, pairs: Sequence[tuple[str, str]], *, batch_size: int = 32, activation: str | None = None,
                precision: str | None = None) -> Tensor:
        """Scores of (query, document) pairs: (N,) float32 for num_labels 1, else (N, num_labels).

        activation: None (the folder's default, as CrossEncoder: sigmoid for num_labels 1 unless config.json names
        another), "identity" (transformers' logits), "sigmoid", "softmax" (over the labels, num_labels > 1:
        CrossEncoder's apply_softmax), "tanh". precision: as PretrainedEncoder.encode's ("int8" included). batch_size: pairs per
        forward; each batch is packed, never padded.
        """
        pairs = check_pairs(pairs)
        precision, activation = self._check(pairs, batch_size, precision, activation)
        runner = self.encoder.resolve_precision(precision, "Reranker.predict")
        step = int(batch_size)
        return self._scores((self.encoder._tokens(pairs[i:i + step], None) for i in range(0, len(pairs), step)),
                            activation, runner)

    def tokens(self, pairs: Sequence[tuple[str, str]]) -> Tokens:
        """``pairs`` tokenized once, as :meth:`predict` runs them (checked as predict checks them): for
        :meth:`predict_tokens`. ``truncated`` says which pairs max_length cut."""
        return self.encoder._tokens(check_pairs(pairs), None)

    def predict_tokens(self, tokens: Tokens, *, batch_size: int = 32, activation: str | None = None,
                       precision: str | None = None) -> Tensor:
        """:meth:`predict` of pairs :meth:`tokens` tokenized: ``predict(pairs, **kw)`` is
        ``predict_tokens(tokens(pairs), **kw)`` bit for bit."""
        if not isinstance(tokens, Tokens) or not len(tokens):
            raise ValueError("predict_tokens takes the Tokens that tokens(pairs) gives, of one pair at least")
        precision, activation = self._check(tokens.ids, batch_size, precision, activation)
        runner = self.encoder.resolve_precision(precision, "Reranker.predict_tokens")
        step = int(batch_size)
        return self._scores((tokens[i:i + step] for i in range(0, len(tokens), step)), activation, runner)

    def _check(self, pairs: Sequence, batch_size: int, precision: str | None, activation: str | None) -> tuple:
        """predict's argument checks: (the precision, the activation to apply)."""
        precision = check_encode_args(pairs, batch_size, "packed", precision, self.encoder.PRECISIONS)
        activation = self.default_activation if activation is None else activation
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be None (the folder's default) or one of {ACTIVATIONS}; got {activation!r}")
        if activation == "softmax" and self.num_labels == 1:
            raise ValueError("activation='softmax' over one label is 1 for every pair; use 'sigmoid' or 'identity'")
        return precision, activation

    def _scores(self, batches: Iterable[Tokens], activation: str, runner: Runner) -> Tensor:
        """Each batch packed, forward, the head on each pair's first token; then the activation."""
        out = []
        with torch.inference_mode():
            for t in batches:
                tokens = pack_ids(t.ids, t.types)
                h = self.encoder._forward_packed(tokens, runner)  # (total, d)
                out.append(self.logits(h[tokens.cu_seqlens[:-1].long()].float()))  # first token of each pair: (B, d)
        scores = torch.cat(out)  # (N, num_labels)
        if activation == "softmax":
            scores = scores.softmax(-1)
        elif activation != "identity":
            scores = torch.sigmoid(scores) if activation == "sigmoid" else torch.tanh(scores)
        return scores.squeeze(-1) if self.num_labels == 1 else scores

    def rank(self, query: str, documents: Sequence[str], *, top_k: int | None = None, batch_size: int = 32,
             activation: str | None = None) -> list[tuple[int, float]]:
        """(index into documents, score) for each document, highest score first (ties: lower index first).

        The score is predict's for (query, document); top_k: keep the best top_k (None: all). Needs num_labels 1.
        """
        if not isinstance(query, str):
            raise ValueError(f"rank takes the query as a str; got {type(query).__name__}")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents \
                or not all(isinstance(d, str) for d in documents):
            raise ValueError("rank takes documents as a non-empty list of str (e.g. rank('query', ['doc a', 'doc b']))")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1):
            raise ValueError(f"top_k must be None or a positive int; got {top_k!r}")
        if self.num_labels != 1:
            raise ValueError(f"rank needs one score per pair; this model has num_labels {self.num_labels}: "
                             "use predict and choose the label to rank by")
        scores = self.predict([(query, d) for d in documents], batch_size=batch_size, activation=activation).tolist()
        order = sorted(range(len(documents)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in order[:top_k]]


def check_pairs(pairs: object) -> list[tuple[str, str]]:
    """pairs as a list of (str, str); ValueError saying what to pass for anything else (an empty list included)."""
    what = "predict takes a non-empty list of (query, document) pairs of str, e.g. [('what is x?', 'x is ...')]"
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Sequence):
        raise ValueError(f"{what}; got {type(pairs).__name__}")
    if not pairs:
        raise ValueError(f"{what}; got an empty list")
    if len(pairs) == 2 and all(isinstance(p, str) for p in pairs):
        raise ValueError(f"{what}; got one pair as two str: wrap it in a list, [(query, document)]")
    for i, p in enumerate(pairs):
        if not (isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(x, str) for x in p)):
            raise ValueError(f"{what}; pairs[{i}] is {type(p).__name__} {p!r:.40}")
        check_text(p[0], f"pairs[{i}][0]")
        check_text(p[1], f"pairs[{i}][1]")
    return [tuple(p) for p in pairs]


def _default_activation(c: dict, num_labels: int, cfg_path: Path) -> str:
    """CrossEncoder 6.2's get_default_activation_fn: config.json's named torch class, else by num_labels."""
    named = (c.get("sentence_transformers") or {}).get("activation_fn") or c.get("sbert_ce_default_activation_function")
    if named is None:
        return "sigmoid" if num_labels == 1 else "identity"
    if named not in _TORCH_ACTIVATIONS:
        raise CheckpointError(f"{cfg_path}: activation_fn {named!r} is not one btlib reproduces "
                              f"({', '.join(_TORCH_ACTIVATIONS)}); use sentence-transformers' CrossEncoder for this model")
    return _TORCH_ACTIVATIONS[named]


def load_reranker(folder: str | Path, *, expected_sha256: str | None = None) -> Reranker:
    """A cross-encoder folder (config.json's architectures[0] one of :data:`HEADS`) as a :class:`Reranker`.

    The encoder loads as load_pretrained loads it (every check, CheckpointError saying what to fix); the head's
    tensors are checked against hidden_size and num_labels (len(id2label), as transformers counts) before use.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    c, cfg_path = read_config(folder)
    arch = (c.get("architectures") or [None])[0]
    if arch not in HEADS:
        raise CheckpointError(f"{cfg_path}: architectures {c.get('architectures')!r} is not a cross-encoder btlib loads "
                              f"({', '.join(HEADS)}); for embeddings use btlib.load_pretrained")
    kinds, dense_key, act, out_key = HEADS[arch]
    if c.get("model_type") not in kinds:
        raise CheckpointError(f"{cfg_path}: {arch} with model_type {c.get('model_type')!r}; it needs one of {kinds}")
    id2label = c.get("id2label")
    num_labels = len(id2label) if isinstance(id2label, dict) and id2label else c.get("num_labels", 2)
    encoder = load_bert(FolderPlan(folder, folder), expected_sha256=expected_sha256)
    kept, d = encoder._hf["unused"], encoder.spec.d_model
    want = {f"{dense_key}.weight": (d, d), f"{dense_key}.bias": (d,), f"{out_key}.weight": (num_labels, d),
            f"{out_key}.bias": (num_labels,)}
    problems = [f"{k}: {'missing' if k not in kept else f'shape {tuple(kept[k].shape)}'}, config implies {s}"
                for k, s in want.items() if k not in kept or tuple(kept[k].shape) != s]
    if problems:
        raise CheckpointError(f"{folder / 'model.safetensors'}: the {arch} head does not match config.json:\n  "
                              + "\n  ".join(problems))
    dense, out = nn.Linear(d, d), nn.Linear(d, num_labels)
    with torch.no_grad():
        for layer, key in ((dense, dense_key), (out, out_key)):
            layer.weight.copy_(kept[f"{key}.weight"])
            layer.bias.copy_(kept[f"{key}.bias"])
    reranker = Reranker(encoder, dense, act, out, _default_activation(c, num_labels, cfg_path))
    if isinstance(id2label, dict) and id2label:  # config.json's label names (TEI's /predict and /info report them)
        reranker.id2label = {int(k): str(v) for k, v in id2label.items()}
    return reranker
