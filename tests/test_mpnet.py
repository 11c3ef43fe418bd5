"""MPNet folders (btlib.pretrained.architectures.mpnet): parity with transformers' MPNetModel and SentenceTransformer
on packed tokens, every path and precision btlib offers, the file's tensors back, bad folders.

The reference is transformers 5.23's MPNetModel (models/mpnet), run on random-weight folders it writes here, and
SentenceTransformer.encode on a sentence-transformers folder over one (mean pooling + Normalize, as
all-mpnet-base-v2). Lengths 1, 2, 17, 40, 97 and 200 in one batch: 200 > max_distance 128, so offsets past the
bucket table's clamp are hit (offsets of 91 and more already share the last bucket; 129 .. 199 check the clamp).
A literal <pad> (id 1) inside a sequence checks the position rule (it keeps position 1, as in transformers).
"""

import copy
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from btlib import PositionBias, device, load_pretrained, to_hf_state_dict  # noqa: E402
from btlib.pretrained import CheckpointError  # noqa: E402
from btlib.pretrained.architectures.mpnet import MPNetEncoder  # noqa: E402
from btlib.pretrained.coverage import family  # noqa: E402
from btlib.pretrained.encoding import pack_ids  # noqa: E402

from st_folders import rel, st_model, write_st  # noqa: E402

TESTED_HERE = ["btlib.pretrained.architectures.mpnet", "btlib.pretrained.folders.checkpoint", "btlib.packed_encoder"]

WORDS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] + [f"w{i}" for i in range(56)]
SMALL = dict(vocab_size=len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=80,
             max_position_embeddings=258)  # 256 tokens after the 2 positions below padding_idx + 1
LENGTHS = [1, 97, 2, 40, 17, 200]
TOL = family("mpnet").fp32_tol


def _randomise(model: torch.nn.Module) -> None:
    """Weights at a scale where attention is far from uniform and the bias moves it (a 0.1 bias on 0.1 weights is
    a visible share of the scores; 1.0 here makes every bucket matter)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_attention_bias" in name:
                p.copy_(torch.randn_like(p))
            else:
                norm = "LayerNorm" in name and name.endswith("weight")
                p.copy_(1 + 0.2 * torch.randn_like(p) if norm else 0.1 * torch.randn_like(p))


def write_folder(folder, masked_lm=False, seed=0, **config):
    """A random-weight MPNet folder as transformers 5.23 saves it (masked_lm: MPNetForMaskedLM, keys under "mpnet.")
    with a word-level tokenizer (<s> $A </s>, pairs <s> $A </s> </s> $B </s>); returns transformers' MPNetModel."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = tf.MPNetConfig(**{**SMALL, **config})
    torch.manual_seed(seed)
    hf = (tf.MPNetForMaskedLM if masked_lm else tf.MPNetModel)(cfg).eval()
    _randomise(hf)
    hf.save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                               unk_token="<unk>", mask_token="<mask>", model_max_length=256).save_pretrained(folder)
    return hf.mpnet if masked_lm else hf


def _seqs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    seqs = [[0] + torch.randint(5, len(WORDS), (n - 1,), generator=g).tolist() for n in lengths]
    for s in seqs:
        if len(s) > 10:
            s[5] = 1  # a literal <pad>: position 1 there, counting on after it (transformers' rule)
    return seqs


def _reference(hf, seqs):
    """transformers' last_hidden_state on the real tokens of a padded batch (padding id 1), packed: (total, d)."""
    T = max(map(len, seqs))
    ids = torch.tensor([s + [1] * (T - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs])
    with torch.inference_mode():
        h = hf(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, d)
    return h[mask.bool()].float()


def _forward(model, seqs, precision="fp32"):
    with torch.inference_mode():
        return model._forward_packed(pack_ids(seqs), model.runner(precision)).float()  # (total, d)


CASES = {"model": {}, "masked-lm-prefix": {"masked_lm": True}, "gelu-new": {"hidden_act": "gelu_new"}}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, write_folder(path, **CASES[request.param])


def test_the_one_encode_loop_and_the_bias_goes_to_the_kernel(case):
    from btlib.pretrained.encoding import SentenceEncoder

    model = load_pretrained(case[1])
    assert isinstance(model, MPNetEncoder) and isinstance(model, SentenceEncoder) and "encode" not in vars(MPNetEncoder)
    assert model.spec.model_type == "mpnet" and model.embeddings.token_type is None and model.spec.position_offset == 2
    bias = model.packed_encoder().bias
    assert isinstance(bias, PositionBias) and bias.kind == "table" and bias.max_distance == 128
    assert tuple(bias.values.shape) == (4, 257)  # a table over offsets, computed per score by the kernel
    seqs = _seqs([3])
    enc = model.packed_encoder()
    with torch.inference_mode():
        x = model._embed(pack_ids(seqs))
        enc.forward_packed(x, *pack_ids(seqs)[2:])
    assert enc._kernels and all(k.bias for k in enc._kernels.values())


@pytest.mark.parametrize("lengths", [LENGTHS, [200], [1]], ids=["mixed", "200", "1"])
def test_hidden_states_match_transformers(case, lengths):
    _, path, hf = case
    model = load_pretrained(path)
    seqs = _seqs(lengths)
    ref = _reference(hf, seqs)
    h = _forward(model, seqs)
    assert h.shape == ref.shape and rel(h, ref) <= TOL


def test_the_bias_is_what_makes_it_match(tmp_path):
    """Without the relative-position bias (or with it clamped at a smaller distance) btlib is far from transformers:
    the parity above is not a BERT that happens to agree."""
    hf = write_folder(tmp_path)
    seqs = _seqs(LENGTHS)
    ref = _reference(hf, seqs)
    model = load_pretrained(tmp_path)
    assert rel(_forward(model, seqs), ref) <= TOL
    model._packed.clear()
    with torch.no_grad():
        model.embeddings.relative.weight.zero_()
    assert rel(_forward(model, seqs), ref) > 1e-2


def test_every_sequence_alone_equals_the_batch(case):
    model = load_pretrained(case[1])
    seqs = _seqs(LENGTHS)
    alone = torch.cat([_forward(model, [s]) for s in seqs])
    assert rel(alone, _forward(model, seqs)) <= 1e-6


def test_bf16_error_is_within_twice_transformers_own(case):
    _, path, hf = case
    model = load_pretrained(path)
    seqs = _seqs(LENGTHS)
    ref = _reference(hf, seqs)
    ours = _forward(model, seqs, "bf16")
    theirs = _reference(copy.deepcopy(hf).to(torch.bfloat16), seqs)
    assert rel(ours, ref) <= 2 * rel(theirs, ref), (rel(ours, ref), rel(theirs, ref))
    assert F.cosine_similarity(ours, ref).min() > 0.999


TEXTS = ["w1", "", "w2 " * 15, " ".join(f"w{i % 50}" for i in range(38)), "w3 w4 " * 47 + "w5",
         " ".join(f"w{i % 56}" for i in range(198)), "w7 <pad> w8"]  # 3, 2, 17, 40, 97, 200, 5 tokens


def test_encode_matches_sentence_transformers_on_every_path(tmp_path):
    """all-mpnet-base-v2's folder shape: mean Pooling + Normalize over an MPNet Transformer."""
    write_folder(tmp_path / "hf")
    folder = write_st(tmp_path / "st", tmp_path / "hf", normalize=True, max_seq_length=256)
    model = load_pretrained(folder)
    assert isinstance(model, MPNetEncoder) and model.max_length == 256
    assert [len(s) for s in model.tokenize(TEXTS)] == [3, 2, 17, 40, 97, 200, 5]
    want = st_model(folder).encode(TEXTS, convert_to_tensor=True)
    for path in ("packed", "slow"):
        assert rel(model.encode(TEXTS, path=path, batch_size=3), want) <= TOL, path
    pairs = [("w1 w2", "w3 w4 w5"), ("w6", "w7")]
    assert rel(model.encode(pairs), st_model(folder).encode(pairs, convert_to_tensor=True)) <= TOL
    for path in ("fastpath", "fastpath_nested"):
        with pytest.raises(ValueError, match=f"path='{path}' is not available for MPNet.*use 'packed'"):
            model.encode(TEXTS, path=path)


def test_bf16_and_int8_encode_track_fp32(tmp_path):
    write_folder(tmp_path)
    model = load_pretrained(tmp_path)
    fp32 = model.encode(TEXTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", device.SlowPrecisionWarning)  # accuracy is checked on every CPU
        assert F.cosine_similarity(model.encode(TEXTS, precision="bf16"), fp32).min() > 0.999
        q8 = model.encode(TEXTS, precision="int8")
    assert model._int8.bias is model.packed_encoder().bias  # the int8 twin adds the same bias
    assert F.cosine_similarity(q8, fp32).min() >= 0.99


def test_the_file_comes_back_bit_for_bit(case):
    from safetensors.torch import load_file

    path = case[1]
    original = load_file(str(path / "model.safetensors"))
    back = to_hf_state_dict(load_pretrained(path))
    assert list(back) == list(original) and all(torch.equal(back[k], v) for k, v in original.items())


def _edit(tmp_path, **changes):
    path = tmp_path / "bad"
    write_folder(path)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes, match", [
    ({"relative_attention_num_buckets": 64}, "relative_attention_num_buckets=64"),
    ({"hidden_act": "silu"}, "hidden_act='silu'"),
    ({"num_hidden_layers": 3}, r"missing encoder.layer.2.attention.attn.q.weight"),
    ({"num_attention_heads": 8}, r"relative_attention_bias.weight: shape \(32, 4\), config implies \(32, 8\)"),
    ({"max_position_embeddings": 2}, "leaves no position for a token"),
])
def test_bad_configs_say_what_is_wrong(tmp_path, changes, match):
    with pytest.raises(CheckpointError, match=match):
        load_pretrained(_edit(tmp_path, **changes))
