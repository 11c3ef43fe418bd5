"""One encode loop for every pretrained encoder (btlib.pretrained.encoding), one home for segment arithmetic
(btlib.padding): both encoder families run the same function objects, and the copies they had are gone."""

import re
from pathlib import Path

import pytest
import torch

import btlib.pretrained.st_modules as st_modules
from btlib.padding import lengths_to_cu_seqlens, packed_positions, segment_ids, segment_mean, segment_sum
from btlib.pretrained import ModernBertEncoder, Pooling, PretrainedEncoder
from btlib.pretrained.encoding import SentenceEncoder, pack_ids
from btlib.pretrained.tokens import Runner, Tokens, check_text

from model_folder import needs_model

BTLIB = Path(__file__).resolve().parents[1] / "btlib"
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] + [f"w{i}" for i in range(20)]
SMALL = dict(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=40,
             global_attn_every_n_layers=2, local_attention=4)


def _modernbert() -> ModernBertEncoder:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return ModernBertEncoder.from_config(SMALL, tok, pooling=Pooling("mean", True))


def test_both_families_run_the_one_loop():
    for cls in (PretrainedEncoder, ModernBertEncoder):
        assert issubclass(cls, SentenceEncoder)
        assert cls.encode is SentenceEncoder.encode and cls.tokenize is SentenceEncoder.tokenize, cls
        assert "encode" not in vars(cls) and "tokenize" not in vars(cls), f"{cls.__name__} has its own loop again"
    gone = {PretrainedEncoder: ("_encode_packed", "_encode_padded"), ModernBertEncoder: ("_pack", "_forward")}
    for cls, names in gone.items():
        assert not [n for n in names if hasattr(cls, n)], f"{cls.__name__} kept its own copy of the loop's steps"
    assert PretrainedEncoder.PATHS == ("packed", "packed_bf16", "fastpath_nested", "fastpath", "slow")
    assert ModernBertEncoder.PATHS == ("packed", "packed_bf16") and "int8" not in ModernBertEncoder.PRECISIONS


def test_segment_arithmetic_lives_in_padding_only():
    """repeat_interleave and index_add_ (segment ids and sums) and the lengths -> mask comparison are written once,
    in btlib.padding. Outside the scan: kernels/ (each kernel carries its own, by design), reference.py (the oracle
    stays self-contained so that it cannot share a bug with the code it checks)."""
    patterns = {"repeat_interleave": r"repeat_interleave\(", "index_add_": r"index_add_\(",
                "arange < lengths": r"arange\([^)]*\)[^\n]*[<>]=? *\(?\w*lengths"}
    found = []
    for path in sorted(BTLIB.rglob("*.py")):
        rel = path.relative_to(BTLIB).as_posix()
        if rel.startswith("kernels/") or rel in ("padding.py", "reference.py"):
            continue
        text = path.read_text()
        found += [f"{rel}: {name}" for name, pattern in patterns.items() if re.search(pattern, text)]
    assert found == [], f"segment arithmetic outside btlib.padding (use segment_ids / segment_sum / ...): {found}"
    assert st_modules.segment_mean is segment_mean and st_modules.segment_ids is segment_ids


def test_segment_helpers_worked_examples():
    cu, max_seqlen = lengths_to_cu_seqlens(torch.tensor([2, 4, 3]))
    assert segment_ids(cu.diff()).tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert packed_positions(cu, 9).tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 2]
    x, seq = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 2, 2])
    assert segment_sum(x, seq, 3).tolist() == [3.0, 0.0, 7.0]
    assert segment_mean(x.view(-1, 1), seq, torch.tensor([2, 0, 2])).view(-1).tolist() == [1.5, 0.0, 3.5]
    tokens = pack_ids([[101, 7, 102], [101, 102]])
    assert tokens.ids.tolist() == [101, 7, 102, 101, 102] and tokens.cu_seqlens.tolist() == [0, 3, 5]
    assert tokens.max_seqlen == 3 and tokens.types is None and tokens.cu_seqlens.dtype == torch.int32


def test_segment_mean_against_a_loop_over_sequences():
    lengths = torch.tensor([1, 97, 0, 5, 2, 0, 33])  # 1 and 97 as everywhere; empty sequences pool to 0
    cu, _ = lengths_to_cu_seqlens(lengths)
    h = torch.randn(int(lengths.sum()), 8)
    ref = torch.stack([h[a:b].mean(0) if b > a else torch.zeros(8) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    got = segment_mean(h, segment_ids(lengths), lengths)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    pos = packed_positions(cu, h.shape[0])
    assert all(pos[a:b].tolist() == list(range(b - a)) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()))


def _spy(monkeypatch):
    calls = []
    real = st_modules.segment_mean
    monkeypatch.setattr(st_modules, "segment_mean", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    return calls


def test_modernbert_pools_through_the_shared_head(monkeypatch):
    model = _modernbert()
    texts = ["w1 w2 w3", "w4", "w5 " * 30, ""]
    plain = model.encode(texts, batch_size=3)
    calls = _spy(monkeypatch)
    assert torch.equal(model.encode(texts, batch_size=3), plain)
    assert [c[0] for c in calls] == [5 + 3 + 32, 2]  # two batches, every real token pooled once
    h = model(*model.pack(texts))
    cu = model.pack(texts)[1]
    ref = torch.nn.functional.normalize(torch.stack([h[a:b].mean(0) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]))
    torch.testing.assert_close(plain, ref, rtol=1e-5, atol=1e-6)


@needs_model
@pytest.mark.parametrize("path", ["packed", "slow"])
def test_bert_pools_through_the_shared_head(model, monkeypatch, path):
    texts = ["a short one", "", "a considerably longer sentence about packing"]
    plain = model.encode(texts, path=path)
    calls = _spy(monkeypatch)
    assert torch.equal(model.encode(texts, path=path), plain)
    assert [c[0] for c in calls] == [sum(map(len, model.tokenize(texts)))]


@needs_model
def test_a_precision_resolves_once_into_a_runner_every_forward_takes(model, monkeypatch):
    """encode resolves its precision once (one Runner per call, whatever the batches), and every batch's forward
    runs that runner's layers; int8 is the int8 twin between fp32 activations, bf16 the bf16 copy."""
    fp32, bf16, int8 = model.runner("fp32"), model.runner("bf16"), model.runner("int8")
    assert isinstance(fp32, Runner) and (fp32.precision, fp32.dtype) == ("fp32", torch.float32)
    assert fp32.layers is model.packed_encoder(torch.float32) and bf16.layers is model.packed_encoder(torch.bfloat16)
    assert (int8.dtype, int8.layers) == (torch.float32, model.int8_encoder())
    assert model.runner(None).precision == "fp32"
    resolved, seen = [], []
    real_resolve, real_forward = model.resolve_precision, model._forward_packed
    monkeypatch.setattr(model, "resolve_precision", lambda p, what: resolved.append(p) or real_resolve(p, what))
    monkeypatch.setattr(model, "_forward_packed", lambda t, r: seen.append(r) or real_forward(t, r))
    texts = ["a short one", "another", "and a third text", "four"]
    assert torch.equal(model.encode(texts, batch_size=1), model.encode(texts, batch_size=4))
    assert resolved == [None, None] and len(seen) == 5 and all(r == seen[0] for r in seen)
    tokens = model.tokens(texts)
    assert isinstance(tokens, Tokens) and len(tokens) == 4
    with pytest.raises(ValueError, match="surrogate|Unicode"):
        check_text("a\ud800b", "texts[0]")
