"""The tokenizer of a model folder as transformers 5.23 (so sentence-transformers 6.2) builds it from the folder's files.

    tok, max_length = tokenizer(plan, limit, max_positions, model_type)   # tokenizer.json + what the other files change
    special_ids(plan, tok) -> set[int]                                    # the ids transformers counts as special
    passes_token_types(plan, model_type) -> bool | None                   # token_type_ids reach the model?

tokenizer.json is not the whole tokenizer. transformers picks a class (tokenizer_config.json's ``tokenizer_class``,
else the one registered for config.json's ``model_type``), and a class with its own constructor rebuilds part of the
tokenizer from tokenizer_config.json's fields, whatever tokenizer.json says. For the BERT family (BertTokenizer,
DistilBertTokenizer, ElectraTokenizer, MPNetTokenizer) that part is the normalizer and the pre-tokenizer:

    BertNormalizer(clean_text=True, handle_chinese_chars=tokenize_chinese_chars (default true),
                   strip_accents=strip_accents (default null: follow lowercase), lowercase=do_lower_case (default true))
    BertPreTokenizer()

so a tokenizer.json that does not lower-case, beside a tokenizer_config.json that says (or defaults to)
do_lower_case, is lower-cased and its accents stripped: btlib builds the same. Then sentence_bert_config.json's
do_lower_case prepends a Lowercase step unless the normalizer is one (sentence-transformers 6.2's Transformer does
exactly this, on the normalizer, not on the text). Fields btlib does not rebuild and that would change the ids are
refused by name: a ``truncation_side`` other than right, and for RoBERTa / XLM-R / CamemBERT an ``add_prefix_space``
that tokenizer_config.json gives and tokenizer.json's pre-tokenizer disagrees with (their classes rebuild the
pre-tokenizer from it; where the field is absent btlib takes tokenizer.json's, as the Hub's folders of these
families agree with their classes' defaults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from .checkpoint import CheckpointError


class FolderPlan(Protocol):
    """What these functions read of btlib.pretrained.folders.st_folder.FolderPlan (a Protocol here: st_folder imports
    this module, and a layer does not import the one above it)."""

    transformer_dir: Path
    do_lower_case: bool
    max_seq_length: int | None

    def file(self, name: str, what: str) -> dict: ...

__all__ = ["tokenizer", "special_ids", "passes_token_types", "tokenizer_class"]

_BERT_FAMILY = {"BertTokenizer", "DistilBertTokenizer", "ElectraTokenizer", "MPNetTokenizer"}
# transformers 5.23's TOKENIZER_MAPPING for the model types btlib loads (None: tokenizer.json as it is)
_REGISTERED = {"bert": "BertTokenizer", "distilbert": "BertTokenizer", "electra": "BertTokenizer",
               "nomic_bert": "BertTokenizer", "mpnet": "MPNetTokenizer", "roberta": "RobertaTokenizer",
               "xlm-roberta": "XLMRobertaTokenizer", "camembert": "CamembertTokenizer"}
# the default of add_prefix_space in each class that rebuilds its pre-tokenizer from it
_PREFIX_SPACE = {"RobertaTokenizer": False, "XLMRobertaTokenizer": True, "CamembertTokenizer": True}


def tokenizer_class(cfg: dict, model_type: str | None) -> str | None:
    """The class transformers builds (without "Fast"): tokenizer_config.json's, else the model type's; None where it
    reads tokenizer.json as it is (TokenizersBackend, PreTrainedTokenizerFast, a model type btlib does not map)."""
    cls = cfg.get("tokenizer_class")
    cls = cls.removesuffix("Fast") if isinstance(cls, str) else _REGISTERED.get(model_type or "")
    return None if cls in (None, "TokenizersBackend", "PreTrainedTokenizer") else cls


def _flag(cfg: dict, key: str, default, path, allowed=(True, False)):
    value = cfg.get(key, default)
    if value not in allowed or not isinstance(value, (bool, type(None))):
        raise CheckpointError(f"{path}: {key} must be {' or '.join(map(str, allowed)).lower()}; got {value!r}")
    return value


def _as_transformers_builds(tok, plan: FolderPlan, model_type: str | None) -> None:
    """Rebuild what transformers' class rebuilds from tokenizer_config.json; refuse what btlib does not rebuild."""
    from tokenizers import normalizers, pre_tokenizers

    path = plan.transformer_dir / "tokenizer_config.json"
    cfg = plan.file("tokenizer_config.json", "tokenizer config")
    if cfg.get("truncation_side", "right") != "right":
        raise CheckpointError(f"{path}: truncation_side={cfg['truncation_side']!r} (transformers then keeps a long text's "
                              "end); btlib truncates on the right as tokenizer.json does; use sentence-transformers")
    cls = tokenizer_class(cfg, model_type)
    if cls in _BERT_FAMILY:
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=_flag(cfg, "tokenize_chinese_chars", True, path),
            strip_accents=_flag(cfg, "strip_accents", None, path, (True, False, None)),
            lowercase=_flag(cfg, "do_lower_case", True, path))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    elif cls in _PREFIX_SPACE and "add_prefix_space" in cfg:  # absent: btlib takes tokenizer.json's as it is
        want = _flag(cfg, "add_prefix_space", _PREFIX_SPACE[cls], path)
        pre = tok.pre_tokenizer
        pres = list(pre) if isinstance(pre, pre_tokenizers.Sequence) else [pre]
        has = [p.add_prefix_space if isinstance(p, pre_tokenizers.ByteLevel) else p.prepend_scheme != "never"
               for p in pres if isinstance(p, (pre_tokenizers.ByteLevel, pre_tokenizers.Metaspace))]
        if has != [want]:
            raise CheckpointError(f"{path}: add_prefix_space={want} ({cls} rebuilds its pre-tokenizer from it), but "
                                  f"tokenizer.json's pre-tokenizer is {pre}; make the two files agree")


def tokenizer(plan: FolderPlan, limit: int, max_positions: int | None = None, model_type: str | None = None):
    """The folder's tokenizer as transformers and sentence-transformers build it (module docstring), unpadded and
    truncated; and its max length.

    The length: max_seq_length if the folder gives one, else tokenizer_config.json's model_max_length capped at
    max_positions (sentence-transformers' order); never more than ``limit``, the positions the model has.
    model_type: config.json's, which picks the class where tokenizer_config.json names none.
    """
    from tokenizers import Tokenizer
    from tokenizers.normalizers import Lowercase, Sequence

    path = plan.transformer_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{plan.transformer_dir} has no tokenizer.json (the fast-tokenizer file the tokenizers "
                              "package reads)")
    tok = Tokenizer.from_file(str(path))
    _as_transformers_builds(tok, plan, model_type)
    if plan.do_lower_case:  # sentence-transformers prepends Lowercase unless the normalizer already has one
        n = tok.normalizer
        if not (isinstance(n, Lowercase) or isinstance(n, Sequence) and any(isinstance(x, Lowercase) for x in n)):
            tok.normalizer = Sequence([Lowercase()] + (list(n) if isinstance(n, Sequence) else [n] if n else []))
    max_length = plan.max_seq_length
    if max_length is None:
        value = plan.file("tokenizer_config.json", "tokenizer config").get("model_max_length")
        max_length = value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else limit
        max_length = min(max_length, max_positions or limit)
    max_length = min(max_length, limit)
    tok.no_padding()  # tokenizer.json may ask for fixed padding; btlib packs instead
    tok.enable_truncation(max_length)  # longest_first for pairs, as transformers' truncation=True
    return tok, max_length


def special_ids(plan: FolderPlan, tok) -> set[int]:
    """The ids transformers counts as special (tokenizer_config.json's named tokens, tokenizer.json's special ones)."""
    ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    cfg = plan.file("tokenizer_config.json", "tokenizer config")
    names = [cfg.get(k) for k in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")]
    names += list(cfg.get("additional_special_tokens") or []) + list(cfg.get("extra_special_tokens") or [])
    for name in names:
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and tok.token_to_id(name) is not None:
            ids.add(tok.token_to_id(name))
    return {i for i in ids if isinstance(i, int)}


# transformers 5.23's model_input_names per tokenizer class: does the tokenizer hand token_type_ids to the model?
_TOKEN_TYPES = {"BertTokenizer": True, "BertJapaneseTokenizer": True, "ElectraTokenizer": True, "RobertaTokenizer": False,
                "XLMRobertaTokenizer": False, "DistilBertTokenizer": False, "CamembertTokenizer": False,
                "MPNetTokenizer": False, "PreTrainedTokenizer": False, "TokenizersBackend": False}


def passes_token_types(plan: FolderPlan, model_type: str) -> bool | None:
    """Whether transformers' tokenizer for the folder gives the model token_type_ids (None: btlib cannot tell)."""
    cfg = plan.file("tokenizer_config.json", "tokenizer config")
    if isinstance(cfg.get("model_input_names"), list):
        return "token_type_ids" in cfg["model_input_names"]
    cls = cfg.get("tokenizer_class")
    if cls is None:  # AutoTokenizer then picks the model type's own tokenizer (ELECTRA's is BertTokenizer)
        return model_type in ("bert", "electra")
    return _TOKEN_TYPES.get(cls.removesuffix("Fast")) if isinstance(cls, str) else None
