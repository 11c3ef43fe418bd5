"""Small random-weight model folders written by transformers and sentence-transformers themselves (offline).

    base = write_hf(tmp_path / "hf", "bert")                     # config.json, model.safetensors, tokenizer files
    folder = write_st(tmp_path / "st", base, pooling="max", dense=[(8, True, nn.Tanh())], normalize=True)
    ref = st_model(folder).encode(texts, convert_to_tensor=True)  # what btlib.load_pretrained(folder).encode must give

The tokenizer is word-level and CASED ("w3" and "W3" are different tokens), with the pair template
[CLS] $A [SEP] $B:1 [SEP]:1, so do_lower_case and token types change the ids.
"""

import os

import torch

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(30)] + [f"W{i}" for i in range(30)]
SPECIAL = {"unk_token": "[UNK]", "pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
TEXTS = ["w1 w2 w3", "W4", "w5 W6 " * 20, "", "W1 w2 W3 w4 W5 w6", "w7 [PAD] w8", "w9 <pad> w10 W10"]


def _quiet():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _randomise(model: torch.nn.Module) -> None:
    """Weights at a scale where attention is far from uniform and token states differ per position."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm_weight = "LayerNorm" in name and name.endswith("weight")
            p.copy_(1 + 0.2 * torch.randn_like(p) if norm_weight else 0.1 * torch.randn_like(p))


def write_hf(folder, arch="bert", tokenizer_class=None, seed=0, model_cls=None, **config):
    """A random tiny transformers model folder (2 layers, hidden 32) with a cased word-level tokenizer; returns folder.

    arch: bert, roberta, xlm-roberta, distilbert, camembert or electra; config: fields over the defaults (hidden_size,
    embedding_size, num_labels, ...); model_cls: the transformers class to save (default: the arch's base model,
    e.g. tf.BertForSequenceClassification for a cross-encoder)."""
    _quiet()
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    roberta = arch in ("roberta", "xlm-roberta", "camembert")
    words = list(WORDS) + ["<pad>"] if roberta else list(WORDS)
    vocab = {w: i for i, w in enumerate(words)}
    pad = vocab["<pad>"] if roberta else 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    common = dict(vocab_size=len(words), pad_token_id=pad, max_position_embeddings=40 + (pad + 1 if roberta else 0))
    if arch == "distilbert":
        cfg, cls = tf.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common, **config), tf.DistilBertModel
    else:
        cfg = {"bert": tf.BertConfig, "roberta": tf.RobertaConfig, "xlm-roberta": tf.XLMRobertaConfig,
               "camembert": tf.CamembertConfig, "electra": tf.ElectraConfig}[arch](
            **{"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
               "type_vocab_size": 2, **common, **config})
        cls = {"bert": tf.BertModel, "roberta": tf.RobertaModel, "xlm-roberta": tf.XLMRobertaModel,
               "camembert": tf.CamembertModel, "electra": tf.ElectraModel}[arch]
    torch.manual_seed(seed)
    hf = (model_cls or cls)(cfg).eval()
    _randomise(hf)
    hf.save_pretrained(folder)
    specials = {**SPECIAL, "pad_token": words[pad]}
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, **specials).save_pretrained(folder)
    if tokenizer_class:  # the class transformers builds, which decides whether token_type_ids reach the model
        import json

        path = folder / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": tokenizer_class}))
    return folder


def write_st(folder, base, *, pooling="mean", include_prompt=True, dense=(), normalize=False, max_seq_length=None,
             prompts=None, default_prompt_name=None, sbert_config=None, seed=1):
    """A sentence-transformers folder over ``base`` saved by SentenceTransformer.save; dense: (out, bias, activation).

    sentence-transformers 6.2 saves max_seq_length as tokenizer_config.json's model_max_length and does not save
    do_lower_case; sbert_config (e.g. {"max_seq_length": 9, "do_lower_case": True}) writes sentence_bert_config.json
    in the form most Hub folders carry, which 6.2 reads.
    """
    _quiet()
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as st

    torch.manual_seed(seed)
    transformer = st.Transformer(str(base), max_seq_length=max_seq_length)
    d = transformer.get_embedding_dimension()
    modules = [transformer, st.Pooling(d, pooling_mode=pooling, include_prompt=include_prompt)]
    d = modules[-1].get_embedding_dimension()
    for out, bias, act in dense:
        modules.append(st.Dense(d, out, bias=bias, activation_function=act))
        with torch.no_grad():
            modules[-1].linear.weight.normal_(0, 0.5)
        d = out
    if normalize:
        modules.append(st.Normalize())
    SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name).save(
        str(folder))
    if sbert_config is not None:
        import json

        (folder / "sentence_bert_config.json").write_text(json.dumps(sbert_config))
    return folder


def st_model(folder):
    _quiet()
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the reference's scale (fp32 parity: <= 1e-5)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
