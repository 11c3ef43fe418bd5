"""ModernBERT folders -> :class:`ModernBertEncoder`: the loader behind ``btlib.load_pretrained`` for model_type "modernbert".

    model = btlib.load_pretrained("ModernBERT-base")    # config.json, model.safetensors, tokenizer.json
    ids, cu_seqlens, max_seqlen = model.pack(texts)    # (total,) int64, (B + 1,) int32, int: no padding
    h = model(ids, cu_seqlens, max_seqlen)             # (total, d) float32, = transformers' last_hidden_state
    emb = model.encode(texts, precision="auto")        # (N, d) pooled as the folder's sentence-transformers files say
    sd = btlib.to_hf_state_dict(model)                 # the file's tensors back, key for key, bit for bit

The published checkpoints (answerdotai/ModernBERT-base / -large, ModernBertForMaskedLM) load
unchanged: their encoder lives under ``model.``; ``head.*`` and ``decoder.*`` (the masked-LM head)
are kept aside, untouched, for :func:`btlib.to_hf_state_dict`. A ModernBertModel folder (no prefix,
as sentence-transformers saves embedding models) loads the same way. Everything is checked before
a module is built (config fields: see btlib.pretrained.folders.modernbert_config; every tensor's presence
and shape; no encoder tensor left unexplained): a folder btlib cannot reproduce exactly raises
CheckpointError naming the field or tensor, never a half-loaded model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..folders.checkpoint import CheckpointError, read_state_dict, verify_sha256
from ..folders.modernbert_config import check_modernbert_tensors, read_modernbert_spec
from .modernbert_model import ModernBertEncoder
from ..folders.st_folder import FolderPlan, read_folder, special_ids, tokenizer as st_tokenizer

__all__ = ["load_modernbert", "load_modernbert_plan"]


def load_modernbert_plan(plan: FolderPlan, *, expected_sha256: str | None = None,
                         config: tuple[dict, Path] | None = None) -> ModernBertEncoder:
    """The loader btlib.load_pretrained calls for model_type "modernbert": :func:`load_modernbert` on a read folder
    (its Transformer at the root), with the folder's sentence-transformers prompts set."""
    folder = Path(plan.root)
    if plan.transformer_dir != folder:
        raise CheckpointError(f"{folder}: btlib's ModernBERT loader reads a Transformer at the folder's root, not in "
                              f"{plan.transformer_dir.name}/; use sentence-transformers for this model")
    model = load_modernbert(folder, expected_sha256=expected_sha256, config=config, plan=plan)
    model.set_prompts(plan.prompts, plan.default_prompt_name, special_ids(plan, model.tokenizer))
    return model


def load_modernbert(folder: str | Path, *, expected_sha256: str | None = None,
                    config: tuple[dict, Path] | None = None, plan: FolderPlan | None = None) -> ModernBertEncoder:
    """Load a ModernBERT folder (config.json with model_type "modernbert", model.safetensors, tokenizer.json).

    expected_sha256: check model.safetensors' hash first. Raises CheckpointError, saying what to
    fix, for a missing or damaged file, a config field btlib cannot reproduce, or tensors that do
    not match the config. Weights stored in bf16/fp16 are upcast to fp32 exactly. config, plan: config.json's
    (dict, path) and the folder as read_folder reads it, where the caller has them (each file is read once per load).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    if expected_sha256:
        verify_sha256(folder / "model.safetensors", expected_sha256)
    spec = read_modernbert_spec(folder, config)
    sd = read_state_dict(folder)
    prefix = check_modernbert_tensors(sd, spec)
    plan = plan or read_folder(folder)  # read once: the tokenizer and the head take its files from it
    tokenizer, max_length = st_tokenizer(plan, spec.max_positions, spec.max_positions, "modernbert")

    model = ModernBertEncoder(spec, tokenizer, max_length, plan.head(spec.d_model))
    mapped = {name: prefix + name for name, _ in model.named_parameters()}  # the same names, under the file's prefix
    with torch.no_grad():
        for ours, p in model.named_parameters():
            p.copy_(sd[mapped[ours]])
    used = set(mapped.values())
    # Not used by the encoder (the masked-LM head, a classifier), kept aside untouched for the reverse.
    model._hf = {"order": list(sd), "dtypes": {k: v.dtype for k, v in sd.items()}, "mapped": mapped, "layers": [],
                 "unused": {k: v for k, v in sd.items() if k not in used}}
    return model
