"""PretrainedEncoder.encode: precision="auto"/"fp32"/"bf16", the slow-bf16 warning, and argument checks."""

import warnings

import pytest
import torch

from btlib import device, hardware
from btlib.pretrained.reference import stored_reference

from model_folder import needs_model

pytestmark = needs_model


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True])
def test_batch_size_must_be_positive(model, batch_size):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        model.encode(["a"], batch_size=batch_size)


@pytest.mark.parametrize("kw, match", [
    ({"path": "packed_fp16"}, "path must be one of"),
    ({"precision": "fp16"}, "precision must be None or one of"),
    ({"path": "packed_bf16", "precision": "fp32"}, "path='packed_bf16' is bf16"),
    ({"path": "fastpath", "precision": "bf16"}, "applies to path='packed' only"),
])
def test_path_and_precision_names_are_checked(model, kw, match):
    with pytest.raises(ValueError, match=match):
        model.encode(["a"], **kw)


def test_precisions_agree_with_the_reference(model):
    sentences, ref, _ = stored_reference()
    assert (model.encode(sentences, precision="fp32") - ref).abs().max() < 1e-5
    auto = model.encode(sentences, precision="auto")
    if device.choose_precision().precision == "fp32":
        assert (auto - ref).abs().max() < 1e-5
    assert torch.nn.functional.cosine_similarity(auto, ref).min() > 0.999
    assert torch.equal(model.encode(sentences, precision="bf16"), model.encode(sentences, path="packed_bf16"))


def test_bf16_on_a_non_native_cpu_warns_once_and_auto_is_fp32(model, monkeypatch, tmp_path, fresh_warnings):
    monkeypatch.setenv("BTLIB_ASSUME_NO_BF16", "1")
    monkeypatch.setattr(hardware, "_memo", {})
    with pytest.warns(device.SlowPrecisionWarning, match=r"PretrainedEncoder.encode in bf16: bf16 is not native.*GFLOP/s") as got:
        model.encode(["a", "b"], path="packed_bf16")
    assert len(got) == 1  # encode's warning only, not PackedEncoder's as well
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.encode(["a"], precision="bf16")
        sentences, ref, _ = stored_reference()
        assert (model.encode(sentences, precision="auto") - ref).abs().max() < 1e-5  # auto = fp32 here
