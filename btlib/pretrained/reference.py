"""The outside reference for pretrained encoders: Hugging Face transformers' own model.

transformers is what btlib is checked and timed against, never on btlib's own paths (btlib[lab] installs
it for the notebooks). :meth:`HFReference.encode` computes sentence
embeddings exactly as sentence-transformers does for all-MiniLM-L6-v2 (tokenize with padding
and truncation to the model's max length, BertModel, mean over real tokens, L2 normalise);
data/minilm_reference_embeddings.json stores its output so the parity check also runs where
transformers is not installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from ..paths import data_file

__all__ = ["transformers_available", "HFReference", "stored_reference"]


def transformers_available() -> str | None:
    """None if the transformers package can be imported, else why not."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return ("the transformers package is not installed: pip install -e '.[lab]' (what make setup installs), "
                "or pip install transformers")
    return None


class HFReference:
    """transformers' AutoModel + AutoTokenizer on a local folder (offline), with mean pooling."""

    def __init__(self, folder: str | Path, max_length: int):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a progress bar per load is noise in a notebook
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.model = AutoModel.from_pretrained(str(folder)).eval()
        self.max_length = max_length

    def encode(self, texts: Sequence[str], batch_size: int = 64) -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for i in range(0, len(texts), batch_size):
                enc = self.tokenizer(list(texts[i:i + batch_size]), padding=True, truncation=True,
                                     max_length=self.max_length, return_tensors="pt")
                h = self.model(**enc).last_hidden_state  # (B, T, d)
                keep = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
                out.append(F.normalize((h * keep).sum(1) / keep.sum(1), dim=-1))
        return torch.cat(out)


def stored_reference() -> tuple[list[str], torch.Tensor, dict]:
    """(sentences, embeddings (N, d) float32, metadata) from data/minilm_reference_embeddings.json."""
    d = json.loads(data_file("minilm_reference_embeddings.json").read_text())
    return d["sentences"], torch.tensor(d["embeddings"], dtype=torch.float32), {k: v for k, v in d.items() if k.startswith("_")}
