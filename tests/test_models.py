"""btlib.models.encoder and btlib.models.xlmr: the encoder shapes and the XLM-R-shaped classifier of the notebooks.

Checked: EncoderConfig.params against the parameters nn.TransformerEncoder really holds, seeded builds that leave the
global RNG alone, dense_twin (shared weights, never nested, the same outputs on real tokens), cached_encoder; the
word tokenizer's ids and padding, RoBERTa's position ids against a plain reference, and logits that do not depend
on the padding a batch adds.
"""

import pytest
import torch

from btlib.models.encoder import TINY, XLMR_LARGE, EncoderConfig, build_encoder, cached_encoder, dense_twin
from btlib.models.xlmr import BOS, EOS, PAD, XLMR_LARGE_CONFIG, WordTokenizer, XLMRClassifier, XLMRConfig

ODD = EncoderConfig(3, 24, 2, 40, "relu", dropout=0.0)  # d and ff not powers of two (nhead even: an odd one turns nested off)


@pytest.mark.parametrize("cfg", [TINY, ODD, TINY.scaled(norm_first=True)])
def test_params_counts_every_parameter(cfg):
    assert cfg.params == sum(p.numel() for p in build_encoder(cfg).parameters())


def test_seeded_build_repeats_and_leaves_the_global_rng_alone():
    state = torch.random.get_rng_state()
    a, b = build_encoder(ODD, seed=3), build_encoder(ODD, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(next(build_encoder(ODD, seed=4).parameters()), next(a.parameters()))


def test_dense_twin_shares_weights_and_matches_on_real_tokens():
    enc = build_encoder(ODD, seed=0).eval()
    twin = dense_twin(enc).eval()
    assert enc.use_nested_tensor and not twin.use_nested_tensor
    assert [p.data_ptr() for p in twin.parameters()] == [p.data_ptr() for p in enc.parameters()]
    x = torch.randn(3, 7, ODD.d_model)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 5:], mask[2, 1:] = True, True  # lengths 7, 5, 1
    with torch.no_grad():
        nested, dense = enc(x, src_key_padding_mask=mask), twin(x, src_key_padding_mask=mask)
    torch.testing.assert_close(nested[~mask], dense[~mask], rtol=1e-5, atol=1e-5)


def test_cached_encoder_is_built_once_in_eval_mode():
    enc, twin = cached_encoder(ODD, seed=1)
    assert cached_encoder(ODD, seed=1)[0] is enc
    assert not enc.training and not twin.training and twin.layers is enc.layers


def test_large_config_is_the_large_encoder():
    assert XLMR_LARGE_CONFIG.encoder == XLMR_LARGE


def test_word_tokenizer_ids_truncation_and_padding():
    tok = WordTokenizer(vocab_size=101, max_length=5)
    ids = tok.encode("How are you!")
    assert len(ids) == 5 and ids[0] == BOS and ids[-1] == EOS  # 4 words + <s> </s>, cut to max_length 5
    assert all(3 <= i < 101 for i in ids[1:-1])
    assert tok.encode("you you")[1] == tok.encode("you")[1]  # a stable hash: same word, same id
    batch = tok(["one", "one two three", ""])
    assert batch.shape == (3, 5) and batch.dtype == torch.int64
    assert batch[0].tolist()[3:] == [PAD, PAD] and batch[2].tolist() == [BOS, EOS, PAD, PAD, PAD]
    with pytest.raises(ValueError, match="at least one text"):
        tok([])
    with pytest.raises(ValueError, match="max_length >= 2"):
        WordTokenizer(max_length=1)


SMALL = XLMRConfig(encoder=ODD, vocab_size=101, max_positions=12, num_classes=3)


def test_positions_follow_roberta():
    torch.manual_seed(0)
    model = XLMRClassifier(SMALL).eval()
    tokens = torch.tensor([[BOS, 5, 6, EOS, PAD, PAD], [BOS, 7, 8, 9, 10, EOS]])
    positions = torch.tensor([[2, 3, 4, 5, PAD, PAD], [2, 3, 4, 5, 6, 7]])  # PAD + 1 + index; PAD at padding
    ref = model.embedding_norm(model.token_embedding(tokens) + model.position_embedding(positions))
    x, mask = model.embed(tokens)
    torch.testing.assert_close(x, ref)
    assert torch.equal(mask, tokens.eq(PAD))


@pytest.mark.parametrize("nested", [True, False])
def test_logits_do_not_depend_on_padding(nested):
    torch.manual_seed(0)
    model = XLMRClassifier(SMALL, enable_nested_tensor=nested).eval()
    tok = WordTokenizer(vocab_size=SMALL.vocab_size, max_length=SMALL.max_positions - 2)
    texts = ["a short one", "a somewhat longer text, with punctuation!", "x"]
    with torch.no_grad():
        batch = model(tok(texts))
        alone = torch.cat([model(tok([t])) for t in texts])
    assert batch.shape == (3, SMALL.num_classes)
    torch.testing.assert_close(batch, alone, rtol=1e-5, atol=1e-5)
