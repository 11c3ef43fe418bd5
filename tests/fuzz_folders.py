"""Random small model folders for the differential fuzzer (tests/test_fuzz_folders.py).

A case is a frozen description (architecture and config fields, tokenizer options, sentence-transformers
module list, texts); :func:`build_folder` writes it to disk as a Hugging Face + sentence-transformers
folder: random weights saved by transformers, a tokenizer.json built offline with the ``tokenizers``
package (WordPiece for BERT, byte-level BPE for RoBERTa and ModernBERT, Unigram for XLM-R), and the
module files in the form the Hub's embedding models carry (modules.json, 1_Pooling/config.json,
2_Dense/, sentence_bert_config.json, config_sentence_transformers.json).
Base folders (weights + tokenizer) are cached per (model, tokenizer) description; module lists are
written on a fresh copy per case.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import strategies as st

ARCHS = ("bert", "roberta", "xlm-roberta", "modernbert")
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
LEGACY_KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
               "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
               "weightedmean": "pooling_mode_weightedmean_tokens", "lasttoken": "pooling_mode_lasttoken"}
DENSE_ACTIVATIONS = ("torch.nn.modules.activation.Tanh", "torch.nn.modules.linear.Identity",
                     "torch.nn.modules.activation.ReLU", "torch.nn.modules.activation.GELU",
                     "torch.nn.modules.activation.Sigmoid")
BERT_ACTS = ("gelu", "relu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")
MODERNBERT_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "silu", "swish")
_READ = {"hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size",
         "max_position_embeddings", "pad_token_id"}
CORRUPTIBLE = {"bert": _READ | {"hidden_act", "layer_norm_eps", "type_vocab_size"},
               "modernbert": _READ | {"hidden_activation", "norm_eps", "norm_bias", "attention_bias", "mlp_bias",
                                      "local_attention", "global_attn_every_n_layers", "global_rope_theta"}}
CORRUPTIBLE["roberta"] = CORRUPTIBLE["xlm-roberta"] = CORRUPTIBLE["bert"]
BAD_VALUES = ("12", None, float("nan"), -1, (1,))  # a string, null, NaN, out of range, a list (JSON)
SPECIALS = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], "modernbert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            "roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]}
# Words for the texts: cased and not, accents, CJK, an emoji, and every special token of every family spelled out
# (the tokenizers know some whole, split others into pieces, and map the rest to their unknown token).
WORDS = ["hello", "World", "the", "Query", "doc", "ÉCOLE", "straße", "naïve", "中文", "🙂", "a", "B", "42", "!?", "[SEP]",
         "[CLS]", "[PAD]", "[MASK]", "[UNK]", "<s>", "</s>", "<pad>", "<unk>", "<mask>", "query:", "passage:"]
CHARS = sorted(set("".join(WORDS[:14])) - {" "}) + list("abcdefghijklmnopqrstuvwxyz")


@dataclass(frozen=True)
class ModelCase:
    """config.json fields (``fields``) of one tiny model, and the tokenizer built beside it."""

    arch: str
    fields: tuple[tuple[str, object], ...]  # sorted (key, value) pairs: hashable, so base folders are cached
    refusable: tuple[str, ...]               # fields whose drawn value is outside btlib's documented support:
                                             # btlib may refuse them by name instead of computing
    corrupt: tuple[str, object] | None       # (field, bad value) written into config.json after the weights
    lowercase: bool                          # a Lowercase step in tokenizer.json's normalizer
    model_max_length: int                    # tokenizer_config.json
    seed: int

    @property
    def config(self) -> dict:
        return {k: json.loads(v) if isinstance(v, str) and v[:1] in "[{" else v for k, v in self.fields}


@dataclass(frozen=True)
class FolderCase:
    """One fuzz case: a model, the sentence-transformers modules around it, and the texts to encode."""

    model: ModelCase
    modes: tuple[str, ...]                   # Pooling's mode(s), concatenated in this order
    legacy_pooling: bool                     # 1_Pooling/config.json with pooling_mode_*_tokens booleans (older folders)
    include_prompt: bool
    dense: tuple[int, bool, str] | None      # (out_features, bias, activation) of a Dense module after Pooling
    normalize: bool
    old_names: bool                          # modules.json types sentence_transformers.models.X (the Hub's form)
    sbert: tuple[tuple[str, object], ...]    # sentence_bert_config.json: max_seq_length / do_lower_case, or empty
    prompt: str | None                       # the default prompt (config_sentence_transformers.json), or none
    texts: tuple[str, ...] = field(default=())


def _bert_fields(draw, broken: bool) -> dict:
    d = draw(st.sampled_from([16, 24, 32, 48]))
    return dict(hidden_size=d, num_hidden_layers=draw(st.integers(1, 2)),
                num_attention_heads=draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0])),
                intermediate_size=draw(st.integers(8, 64)), max_position_embeddings=draw(st.sampled_from([40, 64, 80])),
                hidden_act=draw(st.sampled_from(BERT_ACTS * 2 + ("silu",))),  # silu: btlib may refuse it
                layer_norm_eps=draw(st.sampled_from([1e-12, 1e-5, 1e-3, 0.1])),
                type_vocab_size=draw(st.sampled_from([0, 1, 2, 3] if broken else [1, 2, 3])),  # 0: transformers fails
                **draw(st.sampled_from([{}, {}, {"position_embedding_type": "absolute"},
                                        {"position_embedding_type": "absolute"}, {"position_embedding_type": "relative_key"}])))


def _modernbert_fields(draw) -> dict:
    d, n = draw(st.sampled_from([16, 32, 48])), draw(st.integers(1, 3))
    c = dict(hidden_size=d, num_hidden_layers=n, num_attention_heads=draw(st.sampled_from([h for h in (1, 2, 4) if d % h == 0])),
             intermediate_size=draw(st.integers(8, 48)), max_position_embeddings=draw(st.sampled_from([64, 512])),
             hidden_activation=draw(st.sampled_from(MODERNBERT_ACTS)), norm_eps=draw(st.sampled_from([1e-5, 1e-3, 0.1])),
             norm_bias=draw(st.booleans()), attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    if draw(st.booleans()):
        c["layer_types"] = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=n, max_size=n))
    else:
        c["global_attn_every_n_layers"] = draw(st.integers(1, 3))
    window = draw(st.integers(1, 12))
    c.update(draw(st.sampled_from([{"local_attention": 2 * window}, {"local_attention": 2 * window + 1},
                                   {"sliding_window": window, "local_attention": 128}])))
    theta = st.sampled_from([10.0, 1000.0, 160000.0])
    form = draw(st.sampled_from(["legacy", "legacy", "parameters", "parameters", "scaling", "scaling", "scaling-linear"]))
    if form == "legacy":
        c.update(global_rope_theta=draw(theta), local_rope_theta=draw(theta))
    elif form == "parameters":
        c["rope_parameters"] = {k: {"rope_type": "default", "rope_theta": draw(theta)} for k in ("full_attention", "sliding_attention")}
    else:
        c["rope_scaling"] = {"rope_type": "default" if form == "scaling" else "linear", "rope_theta": draw(theta)}
        if form == "scaling-linear":
            c["rope_scaling"]["factor"] = 2.0
    return c


@st.composite
def model_cases(draw, arch: str, broken: bool = True) -> ModelCase:
    """broken: also draw configs transformers cannot run (a field of the wrong type or range; type_vocab_size 0)."""
    c = _modernbert_fields(draw) if arch == "modernbert" else _bert_fields(draw, broken)
    fields = tuple(sorted((k, json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in c.items()))
    limit = c["max_position_embeddings"] - (2 if arch in ("roberta", "xlm-roberta") else 0)
    refusable = [k for k, ok in (("hidden_act", BERT_ACTS), ("position_embedding_type", ("absolute",))) if c.get(k, ok[0]) not in ok]
    if c.get("rope_scaling", {}).get("rope_type", "default") != "default":
        refusable.append("rope_scaling")
    corrupt = None
    if broken and draw(st.integers(0, 5)) == 0:  # one read field given a value of the wrong type or range
        corrupt = (draw(st.sampled_from(sorted(CORRUPTIBLE[arch]))), draw(st.sampled_from(BAD_VALUES)))
        refusable.append(corrupt[0])
    return ModelCase(arch, fields, tuple(refusable), corrupt, draw(st.booleans()), draw(st.sampled_from([16, limit])),
                     draw(st.integers(0, 3)))


_word = st.one_of(st.sampled_from(WORDS), st.text(max_size=4))


@st.composite
def texts(draw) -> tuple[str, ...]:
    """1-5 texts: a mix of WORDS in random order (cased, unicode, emoji, special tokens spelled out), then
    empty texts, random words (random unicode among them) or over-long texts."""
    mix = st.tuples(st.permutations(WORDS), st.integers(1, 12)).map(lambda t: " ".join(t[0][:t[1]]))
    one = st.one_of(st.just(""), st.lists(_word, min_size=1, max_size=8).map(" ".join),
                    st.tuples(st.sampled_from(WORDS), st.integers(30, 90)).map(lambda t: " ".join([t[0]] * t[1])))
    return (draw(mix),) + tuple(draw(st.lists(one, max_size=4)))


@st.composite
def folder_cases(draw, arch: str, modes: tuple[str, ...] = POOLING_MODES, dense: bool = True, prompts: bool = True,
                 lower_case: bool = True, broken: bool = True) -> FolderCase:
    """A FolderCase; the keyword arguments narrow the strategy (e.g. to the parts one feature needs)."""
    model = draw(model_cases(arch, broken))
    chosen = tuple(draw(st.lists(st.sampled_from(modes), min_size=1, max_size=3, unique=True)))
    legacy = draw(st.booleans())
    if legacy:  # the boolean form can only say which modes, not their order: sentence-transformers concatenates in LEGACY_KEYS order
        chosen = tuple(m for m in LEGACY_KEYS if m in chosen)
    sbert = {}
    if draw(st.booleans()):
        sbert["max_seq_length"] = draw(st.sampled_from([8, 16, model.model_max_length]))
    if lower_case and draw(st.booleans()):
        sbert["do_lower_case"] = draw(st.booleans())
    return FolderCase(model, chosen, legacy, draw(st.booleans()),
                      (draw(st.integers(4, 24)), draw(st.booleans()), draw(st.sampled_from(DENSE_ACTIVATIONS)))
                      if dense and draw(st.booleans()) else None,
                      draw(st.booleans()), draw(st.booleans()), tuple(sorted(sbert.items())),
                      draw(st.sampled_from(["query: ", "Represent this: ", "passage:"])) if prompts and draw(st.booleans()) else None,
                      draw(texts()))


def _tokenizer(arch: str, lowercase: bool):
    """A tiny tokenizers.Tokenizer of the family's kind, with its post-processor and special tokens."""
    from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    specials = SPECIALS[arch]
    corpus = [w for w in WORDS if w not in sum(SPECIALS.values(), [])] * 3
    if arch == "bert":
        vocab = specials + CHARS + [f"##{c}" for c in CHARS] + [w.lower() for w in WORDS[:5]]
        tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(dict.fromkeys(vocab))}, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=False)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    elif arch == "xlm-roberta":
        pieces = [(s, 0.0) for s in specials[:4]] + [("▁", -2.0)] + [(c, -3.0) for c in CHARS]
        pieces += [("▁" + w.lower(), -1.0) for w in WORDS[:5]] + [("<mask>", 0.0)]
        tok = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
        tok.normalizer = normalizers.Lowercase() if lowercase else None
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    else:  # byte-level BPE: RoBERTa, ModernBERT
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
        tok.normalizer = normalizers.Lowercase() if lowercase else None
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = {s: tok.token_to_id(s) for s in specials}
    if arch == "roberta":
        tok.post_processor = processors.RobertaProcessing(("</s>", ids["</s>"]), ("<s>", ids["<s>"]))
    elif arch == "xlm-roberta":
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                           special_tokens=[("<s>", ids["<s>"]), ("</s>", ids["</s>"])])
    else:
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                           special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    return tok, ids


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights at a scale where attention is far from uniform and every norm's weight and bias matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if "norm" in name.lower() and name.endswith("weight") else 0.1 * noise)


def build_base(case: ModelCase, folder: Path) -> None:
    """config.json + model.safetensors (random weights, saved by transformers) + the tokenizer files."""
    import transformers as tf
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tok, ids = _tokenizer(case.arch, case.lowercase)
    specials = SPECIALS[case.arch]
    if case.arch == "modernbert":  # only the drawn fields: ModernBertConfig().to_dict() would add 22 layer_types
        config = dict(model_type="modernbert", architectures=["ModernBertModel"], vocab_size=tok.get_vocab_size(),
                      pad_token_id=ids["[PAD]"], cls_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"],
                      bos_token_id=ids["[CLS]"], eos_token_id=ids["[SEP]"])
        model_cls = tf.ModernBertModel
    else:
        cls = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "xlm-roberta": tf.XLMRobertaConfig}[case.arch]
        config = cls(vocab_size=tok.get_vocab_size(), pad_token_id=ids["[PAD]" if case.arch == "bert" else "<pad>"]).to_dict()
        model_cls = {"bert": tf.BertModel, "roberta": tf.RobertaModel, "xlm-roberta": tf.XLMRobertaModel}[case.arch]
    folder.mkdir(parents=True)
    config.update(case.config)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    hf = model_cls(model_cls.config_class.from_pretrained(folder)).eval()
    _randomise(hf, case.seed)
    hf.save_pretrained(folder)
    if case.corrupt:
        config[case.corrupt[0]] = case.corrupt[1]
    (folder / "config.json").write_text(json.dumps(config, indent=1))  # the fields exactly as drawn, not re-serialised
    names = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")))
    if case.arch in ("roberta", "xlm-roberta"):
        names = dict(bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>", mask_token="<mask>",
                     cls_token="<s>", sep_token="</s>")
    assert set(names.values()) <= set(specials)
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=case.model_max_length, **names)
    fast.save_pretrained(folder)


def write_modules(case: FolderCase, folder: Path) -> None:
    """The sentence-transformers files of ``case`` into ``folder`` (a copy of its base folder)."""
    d = case.model.config["hidden_size"]
    new = {"Transformer": "sentence_transformers.base.modules.transformer.Transformer",
           "Pooling": "sentence_transformers.sentence_transformer.modules.pooling.Pooling",
           "Dense": "sentence_transformers.base.modules.dense.Dense",
           "Normalize": "sentence_transformers.base.modules.normalize.Normalize"}
    kinds = ["Transformer", "Pooling"] + (["Dense"] if case.dense else []) + (["Normalize"] if case.normalize else [])
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Dense": "2_Dense", "Normalize": f"{len(kinds) - 1}_Normalize"}
    modules = [{"idx": i, "name": str(i), "path": paths[k],
                "type": f"sentence_transformers.models.{k}" if case.old_names else new[k]} for i, k in enumerate(kinds)]
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    (folder / "sentence_bert_config.json").write_text(json.dumps(dict(case.sbert)))
    pooling = {"include_prompt": case.include_prompt}
    if case.legacy_pooling:
        pooling.update(word_embedding_dimension=d, **{key: mode in case.modes for mode, key in LEGACY_KEYS.items()})
    else:
        pooling.update(embedding_dimension=d, pooling_mode=list(case.modes) if len(case.modes) > 1 else case.modes[0])
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if case.dense:
        from safetensors.torch import save_file

        out, bias, act = case.dense
        (folder / "2_Dense").mkdir()
        (folder / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": d * len(case.modes), "out_features": out, "bias": bias, "activation_function": act}))
        g = torch.Generator().manual_seed(case.model.seed + 1)
        weights = {"linear.weight": 0.3 * torch.randn(out, d * len(case.modes), generator=g)}
        if bias:
            weights["linear.bias"] = 0.3 * torch.randn(out, generator=g)
        save_file(weights, str(folder / "2_Dense" / "model.safetensors"))
    if case.normalize:
        (folder / paths["Normalize"]).mkdir()
        (folder / paths["Normalize"] / "config.json").write_text("{}")
    prompts = {"default_prompt_name": "default", "prompts": {"default": case.prompt}} if case.prompt else {"prompts": {}}
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**prompts, "similarity_fn_name": "cosine"}))


class Folders:
    """Writes case folders under ``root``, building each distinct base folder once."""

    def __init__(self, root: Path):
        self.root, self.bases, self.count = root, {}, 0

    def folder(self, case: FolderCase) -> Path:
        if case.model not in self.bases:
            base = self.root / f"base{len(self.bases)}"
            build_base(case.model, base)
            self.bases[case.model] = base
        self.count += 1
        out = self.root / f"case{self.count}"
        shutil.copytree(self.bases[case.model], out)
        write_modules(case, out)
        return out
