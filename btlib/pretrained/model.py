"""The BERT family's old import path: btlib.pretrained.model.PretrainedEncoder and the rest still import from here.

The code lives by what it owns: the architecture and its loader in btlib.pretrained.architectures.bert, the encode loop,
prompts and encode's argument checks in btlib.pretrained.encoding, packed positions in btlib.padding.
"""

from ..padding import packed_positions
from .architectures.bert import PATHS, Embeddings, PretrainedEncoder
from .encoding import Prompts, check_encode_args, check_texts
from .st_modules import Pooling

__all__ = ["PretrainedEncoder", "PATHS", "Pooling", "check_texts", "Embeddings", "Prompts", "check_encode_args",
           "packed_positions"]
