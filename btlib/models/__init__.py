"""Model shapes used by the notebooks: encoder configs and an XLM-R-shaped classifier."""

from .gpt import GPT, GPT_SMALL, GPTConfig, build_gpt, gpt_batch, train_step, with_attention
from .encoder import BERT_BASE, MINILM_L6, TINY, XLMR_BASE, XLMR_LARGE, EncoderConfig, build_encoder, cached_encoder, dense_twin
from .xlmr import XLMR_BASE_CONFIG, XLMR_LARGE_CONFIG, WordTokenizer, XLMRClassifier, XLMRConfig

__all__ = ["BERT_BASE", "MINILM_L6", "TINY", "XLMR_BASE", "XLMR_LARGE", "EncoderConfig", "build_encoder", "cached_encoder", "dense_twin",
           "XLMR_BASE_CONFIG", "XLMR_LARGE_CONFIG", "WordTokenizer", "XLMRClassifier", "XLMRConfig"]
