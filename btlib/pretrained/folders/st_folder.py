"""Read a model folder the way sentence-transformers 6.2 does: modules.json, each module's config, the prompts.

    plan = read_folder(folder)       # where the Transformer lives, its settings, the modules after it
    head = plan.head(d_model)        # SentenceHead: PoolingModule, DenseModule, NormalizeModule (st_modules)
    tok, max_length = tokenizer(plan, limit)   # as transformers builds it (tokenizer_files.py), do_lower_case applied
    plan.file("tokenizer_config.json", "tokenizer config")   # a JSON file of the Transformer's folder, read once per load

With modules.json: each entry's ``type`` (a ``sentence_transformers.*`` class path ending in Transformer,
Pooling, Dense or Normalize) and ``path``, in order; the Transformer first, with its
sentence_bert_config.json (max_seq_length, do_lower_case); config_sentence_transformers.json gives
prompts, default_prompt_name and truncate_dim. Any other module type, and any option btlib does not
reproduce, is refused at load time by name (CheckpointError naming the module and its folder).
Without modules.json, sentence-transformers builds Transformer + mean Pooling (no Normalize, no
sentence_bert_config.json): btlib does the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint import CheckpointError
from .tokenizer_files import passes_token_types, special_ids, tokenizer
from ..st_modules import MODULE_TYPES, PoolingModule, SentenceHead, read_json

__all__ = ["FolderPlan", "read_folder", "tokenizer", "special_ids", "passes_token_types"]

# sentence_bert_config.json keys that cannot change the vectors (how transformers loads the weights, FA2 unpadding)
# or that are sentence-transformers' text-only defaults; anything else not read below is refused by name.
_TRANSFORMER_KEYS = {"max_seq_length", "do_lower_case", "model_args", "model_kwargs", "config_args", "config_kwargs",
                     "tokenizer_args", "processor_kwargs", "transformer_task", "modality_config", "module_output_name",
                     "unpad_inputs", "processing_kwargs", "query_length", "document_length", "query_expansion",
                     "tokenizer_name_or_path"}
_HARMLESS_LOAD_KWARGS = {"trust_remote_code", "revision", "token", "cache_dir", "local_files_only", "use_fast",
                         "subfolder", "code_revision", "use_auth_token"}


@dataclass
class FolderPlan:
    """What a folder says, read and checked before any weight is loaded."""

    root: Path
    transformer_dir: Path                 # the Transformer module's folder (config.json, weights, tokenizer)
    modules: list[tuple[type, Path]] = field(default_factory=list)  # after the Transformer: (class, its folder)
    max_seq_length: int | None = None     # sentence_bert_config.json (or processor_kwargs' model_max_length)
    do_lower_case: bool = False
    prompts: dict[str, str | None] = field(default_factory=dict)
    default_prompt_name: str | None = None
    truncate_dim: int | None = None
    sentence_transformers: bool = False   # True when modules.json exists
    _files: dict[str, dict] = field(default_factory=dict, repr=False)  # file name -> its JSON, read once per load

    def file(self, name: str, what: str) -> dict:
        """JSON file ``name`` of the Transformer's folder ({} when absent), read once however many loading steps ask."""
        if name not in self._files:
            self._files[name] = read_json(self.transformer_dir / name, what)
        return self._files[name]

    def head(self, d: int) -> SentenceHead:
        """The modules after the Transformer, built on a d-dimensional encoder (config and weights checked)."""
        if not self.sentence_transformers:
            return SentenceHead([PoolingModule(d)])
        built = []
        for cls, folder in self.modules:
            built.append(cls.load(folder, d))
            d = built[-1].output_dim(d)
        return SentenceHead(built, self.truncate_dim)


def _entry_class(entry: object, i: int, path: Path) -> tuple[str, type | None, Path]:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str) or not isinstance(entry.get("path"), str):
        raise CheckpointError(f"{path}: entry {i} must be an object with a string 'type' and 'path'; got {entry!r}")
    rel = Path(entry["path"])
    if rel.is_absolute() or ".." in rel.parts:
        raise CheckpointError(f"{path}: entry {i} path {entry['path']!r} must stay inside the model folder")
    kind = entry["type"]
    name = kind.rpartition(".")[2]
    known = kind.startswith("sentence_transformers.") and (name == "Transformer" or name in MODULE_TYPES)
    if name in ("MLMTransformer", "SpladePooling", "SparseStaticEmbedding") and not entry.get("kwargs"):
        raise CheckpointError(f"{path}: {name} makes a sparse (SPLADE) model, not a dense one: load it with "
                              "btlib.pretrained.load_sparse (MLMTransformer + SpladePooling)")
    if not known or entry.get("kwargs"):
        what = f"module type {kind!r}" + (f" with kwargs {entry['kwargs']!r}" if known else "")
        raise CheckpointError(f"{path}: {what} (folder {entry['path']!r}) is not supported by btlib, which reads "
                              "Transformer, Pooling, Dense and Normalize; use sentence-transformers for this model")
    return name, MODULE_TYPES.get(name), rel


# the names sentence-transformers tries, in its order (older folders name the file after the architecture)
_CONFIG_NAMES = ("sentence_bert_config.json", "sentence_roberta_config.json", "sentence_distilbert_config.json",
                 "sentence_camembert_config.json", "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                 "sentence_xlnet_config.json")


def _transformer_settings(plan: FolderPlan) -> None:
    path = next((p for p in (plan.transformer_dir / n for n in _CONFIG_NAMES) if p.is_file()),
                plan.transformer_dir / _CONFIG_NAMES[0])
    c = read_json(path, "Transformer config")
    extra = sorted(set(c) - _TRANSFORMER_KEYS)
    if extra:
        raise CheckpointError(f"{path}: Transformer option(s) {extra} are not supported by btlib; "
                              "use sentence-transformers for this model")

    def refuse(key: str, why: str) -> None:
        raise CheckpointError(f"{path}: {key}={c[key]!r} ({why}); use sentence-transformers for this model")

    if c.get("transformer_task", "feature-extraction") != "feature-extraction":
        refuse("transformer_task", "btlib computes feature-extraction token states only")
    if c.get("module_output_name", "token_embeddings") != "token_embeddings":
        refuse("module_output_name", "btlib hands token_embeddings to the Pooling")
    modality = c.get("modality_config", {"text": {"method": "forward", "method_output_name": "last_hidden_state"}})
    if modality != {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}:
        refuse("modality_config", "btlib reads text through the model's forward only")
    for key in ("processing_kwargs", "query_length", "document_length", "query_expansion", "tokenizer_name_or_path"):
        if c.get(key):
            refuse(key, "btlib tokenizes with the folder's own tokenizer.json and its max length")
    for key in ("config_args", "config_kwargs"):
        if set(c.get(key) or {}) - _HARMLESS_LOAD_KWARGS:
            refuse(key, "it overrides config.json fields; btlib reads config.json as it is")
    for key in ("model_args", "model_kwargs"):  # AutoModel.from_pretrained's: a dtype changes every vector
        args = c.get(key) or {}
        dtype = str(args.get("dtype", args.get("torch_dtype", "auto"))).removeprefix("torch.")
        if set(args) - _HARMLESS_LOAD_KWARGS - {"attn_implementation", "dtype", "torch_dtype"} or dtype not in ("auto", "float32"):
            refuse(key, "btlib computes in float32 from the weights as stored (encode's precision= picks bf16 or int8) "
                        "and honours no other model option")
    max_len = c.get("max_seq_length")
    for key in ("tokenizer_args", "processor_kwargs"):
        args = c.get(key) or {}
        if set(args) - _HARMLESS_LOAD_KWARGS - {"model_max_length"}:
            refuse(key, "btlib honours model_max_length there and nothing else")
        if "model_max_length" in args:  # sentence-transformers lets it win over max_seq_length
            max_len = args["model_max_length"]
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1):
        raise CheckpointError(f"{path}: max_seq_length must be a positive integer or null; got {max_len!r}")
    if not isinstance(c.get("do_lower_case", False), bool):
        raise CheckpointError(f"{path}: do_lower_case must be true or false; got {c['do_lower_case']!r}")
    plan.max_seq_length, plan.do_lower_case = max_len, c.get("do_lower_case", False)


def _model_config(plan: FolderPlan) -> None:
    path = plan.root / "config_sentence_transformers.json"
    c = read_json(path, "sentence-transformers model config")
    if c.get("model_type", "SentenceTransformer") != "SentenceTransformer":
        raise CheckpointError(f"{path}: model_type {c['model_type']!r} is not a SentenceTransformer (dense embeddings); "
                              "use sentence-transformers for this model")
    prompts = c.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, (str, type(None))) for v in prompts.values()):
        raise CheckpointError(f"{path}: prompts must map names to prompt strings; got {prompts!r}")
    name = c.get("default_prompt_name")
    if name is not None and name not in {"query": None, "document": None, **prompts}:  # s-t's defaults count
        raise CheckpointError(f"{path}: default_prompt_name {name!r} is not one of the prompts {sorted(prompts)}")
    dim = c.get("truncate_dim")
    if dim is not None and (not isinstance(dim, int) or isinstance(dim, bool) or dim < 1):
        raise CheckpointError(f"{path}: truncate_dim must be a positive integer or null; got {dim!r}")
    plan.prompts, plan.default_prompt_name, plan.truncate_dim = prompts, name, dim


def read_folder(folder: Path) -> FolderPlan:
    """modules.json and the sentence-transformers configs of ``folder``; CheckpointError naming what btlib cannot run."""
    path = folder / "modules.json"
    if not path.is_file():
        return FolderPlan(folder, folder)
    try:
        entries = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from the model's source") from None
    if not isinstance(entries, list) or not entries:
        raise CheckpointError(f"{path} must hold a non-empty list of modules; got {entries!r}")
    parsed = [_entry_class(e, i, path) for i, e in enumerate(entries)]
    if parsed[0][0] != "Transformer" or any(name == "Transformer" for name, _, _ in parsed[1:]):
        raise CheckpointError(f"{path}: btlib needs exactly one Transformer, first; got {[n for n, _, _ in parsed]}")
    kinds = [name for name, _, _ in parsed[1:]]
    if kinds[:1] != ["Pooling"] or kinds.count("Pooling") != 1:
        raise CheckpointError(f"{path}: btlib needs one Pooling right after the Transformer (then Dense / Normalize); "
                              f"got {kinds}; use sentence-transformers for this model")
    plan = FolderPlan(folder, folder / parsed[0][2], [(cls, folder / rel) for _, cls, rel in parsed[1:]],
                      sentence_transformers=True)
    _transformer_settings(plan)
    _model_config(plan)
    return plan
