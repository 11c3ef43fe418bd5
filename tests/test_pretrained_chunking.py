"""encode(long_inputs="chunk") against chunks built by hand: tokenize without truncation, cut the content at the same
windows ([CLS] window [SEP], consecutive windows sharing the overlap), run each chunk alone through
sentence-transformers' Transformer and Pooling (the modules before its Normalize), token-weighted mean, normalise:
within 1e-5. Also: a text at exactly max_length is one chunk, bit for bit plain encode; the empty text; prompts;
chunks spread over several batches; truncate_dim after pooling; "refuse"; and every refusal's message.
"""

import pytest
import torch
from tokenizers import Tokenizer

from btlib.pretrained.chunking import pool_chunks, windows
from btlib.pretrained.encoding import Tokens
from model_folder import FOLDER, needs_model

pytestmark = needs_model
# btlib.pretrained.prompts (moved out of encoding.py): its prompt_length is what every chunk repeats, checked below;
# prompt_name and default prompts against sentence-transformers are tests/test_st_modules.py's
TESTED_HERE = ["btlib.pretrained.prompts"]
CLS, SEP, MAX = 101, 102, 256


@pytest.fixture(scope="module")
def st():
    return pytest.importorskip("sentence_transformers").SentenceTransformer(str(FOLDER), device="cpu")


def long_text(n: int, seed: int) -> str:
    words = "packing padding attention token window chunk encoder sequence batch layer".split()
    return " ".join(words[(i * 7 + seed) % len(words)] + ("s" if (i + seed) % 5 == 0 else "") for i in range(n))


def by_hand(model, st, text: str, overlap: int, prompt: str = "") -> torch.Tensor:
    """(384,) float32: the reference chunking, independent of btlib.pretrained.chunking."""
    tok = Tokenizer.from_str(model.tokenizer.to_str())
    tok.no_truncation()
    content = tok.encode(prompt + text, add_special_tokens=False).ids
    p = len(tok.encode(prompt, add_special_tokens=False).ids) if prompt else 0
    head, body = content[:p], content[p:]
    window = MAX - 2 - p
    starts = list(range(0, max(len(body) - overlap, 1), window - overlap))
    starts = [s for k, s in enumerate(starts) if k == 0 or starts[k - 1] + window < len(body)]
    rows, weights = [], []
    for s in starts:
        ids = torch.tensor([[CLS, *head, *body[s:s + window], SEP]])
        features = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        with torch.inference_mode():
            rows.append(st[1](st[0](features))["sentence_embedding"][0])  # Transformer, Pooling: before Normalize
        weights.append(ids.shape[1])
    w = torch.tensor(weights, dtype=torch.float32)
    mean = (torch.stack(rows) * w[:, None]).sum(0) / w.sum()
    return torch.nn.functional.normalize(mean, dim=0)


@pytest.mark.parametrize("overlap", [None, 0, 100])
def test_chunks_equal_the_hand_built_reference(model, st, overlap):
    texts = [long_text(600, 1), "a short text", long_text(300, 2), long_text(1000, 3)]
    got = model.encode(texts, long_inputs="chunk", chunk_overlap=overlap, batch_size=3)  # chunks span batches
    assert got.shape == (4, 384)
    for i, t in enumerate(texts):
        ref = by_hand(model, st, t, 254 // 8 if overlap is None else overlap)
        assert float((got[i] - ref).abs().max()) <= 1e-5, i
    tokens = model.tokens(texts, long_inputs="chunk", chunk_overlap=overlap)
    assert tokens.texts() == 4 and sum(tokens.chunks) == len(tokens) and tokens.chunks[1] == 1
    assert all(n <= MAX for n in tokens.lengths()) and all(ids[0] == CLS and ids[-1] == SEP for ids in tokens.ids)
    assert torch.equal(model.encode_tokens(tokens, batch_size=3), got)


def test_chunks_with_a_prompt(model, st):
    text = long_text(500, 4)
    got = model.encode([text], long_inputs="chunk", prompt="query: ")
    assert model.prompt_length("query: ") == 1 + 2  # [CLS] query : (the Pooling includes them: include_prompt true)
    assert float((got[0] - by_hand(model, st, text, (254 - 2) // 8, prompt="query: ")).abs().max()) <= 1e-5


def test_max_length_text_is_one_chunk_and_plain_encode(model):
    exact = " ".join(["word"] * 254)  # 254 tokens + [CLS] + [SEP] = 256
    over = exact + " word"
    assert [len(ids) for ids in model.tokenize([exact, over])] == [256, 256]
    tokens = model.tokens([exact, over, ""], long_inputs="chunk")
    assert tokens.chunks == [1, 2, 1] and tokens.ids[0] == model.tokenize([exact])[0]
    for t in (exact, ""):
        assert torch.equal(model.encode([t], long_inputs="chunk"), model.encode([t]))
    assert torch.equal(model.encode([exact], long_inputs="refuse"), model.encode([exact]))


def test_truncate_dim_applies_after_pooling(model):
    texts = [long_text(700, 5), "short"]
    full = model.encode(texts, long_inputs="chunk")
    cut = model.encode(texts, long_inputs="chunk", truncate_dim=97, normalize_embeddings=True)
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:, :97], dim=1), atol=1e-6, rtol=0)
    assert model.encode(texts, long_inputs="chunk", output_precision="ubinary").shape == (2, 48)


def test_windows_and_pooling_helpers():
    assert windows(10, 4, 1) == [(0, 4), (3, 7), (6, 10)]
    assert windows(4, 4, 3) == [(0, 4)] and windows(0, 4, 0) == [(0, 0)] and windows(5, 4, 0) == [(0, 4), (4, 5)]
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [3.0, 3.0]])
    assert torch.equal(pool_chunks(rows, [2, 1], [3, 1, 7]), torch.tensor([[0.75, 0.25], [3.0, 3.0]]))


@pytest.mark.parametrize("kw, match", [
    ({"long_inputs": "split"}, r"long_inputs must be one of \('refuse', 'truncate', 'chunk'\)"),
    ({"long_inputs": "chunk", "chunk_overlap": 254}, r"chunk_overlap=254 must be below the chunk window of 254"),
    ({"long_inputs": "chunk", "chunk_overlap": -1}, r"chunk_overlap must be an int >= 0"),
    ({"long_inputs": "chunk", "chunk_overlap": 2.5}, r"chunk_overlap must be an int >= 0"),
    ({"chunk_overlap": 8}, r"chunk_overlap=8 applies to long_inputs='chunk' only"),
    ({"long_inputs": "refuse"}, r"texts\[1\] has more than 256 tokens .*long_inputs='refuse'"),
])
def test_refusals(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.encode(["short", long_text(400, 6)], **kw)


def test_pairs_and_token_states_are_not_chunked(model):
    with pytest.raises(ValueError, match=r"long_inputs='chunk' takes str texts; texts\[0\] is tuple"):
        model.encode([("a query", long_text(400, 7))], long_inputs="chunk")
    tokens = model.tokens([long_text(400, 8)], long_inputs="chunk")
    with pytest.raises(ValueError, match="chunked tokens give pooled rows only"):
        model.encode_tokens(tokens, output="token_embeddings")
    joined = Tokens.join([tokens, model.tokens(["short"])])
    assert tokens.chunks[0] > 1 and joined.chunks == tokens.chunks + [1] and joined.texts() == 2
