"""Differential fuzzer: random small model folders, btlib against sentence-transformers and transformers.

Each example writes a folder (tests/fuzz_folders.py: a BERT, RoBERTa, XLM-R or ModernBERT config with
random supported fields, a tokenizer.json with random options, a random sentence-transformers module
list: Transformer, Pooling with one to three modes, optional Dense, optional Normalize, a default
prompt with include_prompt on or off, max_seq_length / do_lower_case) and random texts (empty,
unicode, emoji, special tokens spelled out, longer than max_seq_length). Then:

    btlib.load_pretrained(folder).encode(texts)  ==  SentenceTransformer(folder, device="cpu").encode(texts)
    btlib's hidden states of the tokenized texts ==  transformers' AutoModel last_hidden_state

at fp32 tolerance (max |difference| <= 1e-5 x the reference's max |value|), or btlib refuses: where
sentence-transformers itself fails, btlib must raise CheckpointError / ValueError / TypeError; where it
succeeds, btlib may refuse only a field drawn outside btlib's documented support, and must name it.

Budget: BTLIB_FUZZ_EXAMPLES examples in all (default 32, split over the four architectures; derandomized,
so `make test` runs the same cases every time). A longer run:
    BTLIB_FUZZ_EXAMPLES=500 python -m pytest tests/test_fuzz_folders.py -p no:cacheprovider
"""

import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from btlib import load_pretrained
from btlib.pretrained import CheckpointError, ModernBertEncoder
from btlib.pretrained.reference import transformers_available
from fuzz_folders import ARCHS, FolderCase, Folders, folder_cases

pytestmark = pytest.mark.skipif(transformers_available() is not None, reason="transformers is not installed")

EXAMPLES = int(os.environ.get("BTLIB_FUZZ_EXAMPLES", "32"))
FUZZ = settings(max_examples=max(1, EXAMPLES // len(ARCHS)), derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture], print_blob=False)
TOL = 1e-5
RUN = {"cases": 0, "compared": 0, "refused": 0}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return Folders(tmp_path_factory.mktemp("fuzz"))


def _close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)}, reference {tuple(ref.shape)}"
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = float((ours - ref).abs().max()) if ref.numel() else 0.0
    assert err <= TOL * max(scale, 1e-30), f"{what}: max |diff| {err:.3g} > {TOL} x reference scale {scale:.3g}"


def _reference(folder, texts):
    """sentence-transformers' embeddings (N, k) float32, or the exception it raised (loading or encoding)."""
    from sentence_transformers import SentenceTransformer

    try:
        model = SentenceTransformer(str(folder), device="cpu")
        return model.encode(list(texts), convert_to_tensor=True, batch_size=3, show_progress_bar=False).float()
    except Exception as e:  # noqa: BLE001 - any failure of the reference means btlib must refuse
        return e


def _hidden_states(model, ids: list[list[int]]) -> torch.Tensor:
    """btlib's last hidden states (total, d) of token id lists, sequence after sequence."""
    with torch.inference_mode():
        if isinstance(model, ModernBertEncoder):
            return model(*model.pack(ids))
        return model.packed_encoder().forward_packed(*model._packed_inputs(ids))


def _transformers_states(folder, ids: list[list[int]], pad: int) -> torch.Tensor:
    """transformers' AutoModel last_hidden_state on the real tokens of a right-padded batch: (total, d)."""
    import transformers as tf

    hf = tf.AutoModel.from_pretrained(folder).eval()
    T = max(map(len, ids))
    input_ids = torch.tensor([s + [pad] * (T - len(s)) for s in ids])
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in ids])
    with torch.inference_mode():
        return hf(input_ids=input_ids, attention_mask=mask).last_hidden_state[mask.bool()]


def _refused(case: FolderCase, ref, e: Exception, at_load: bool) -> None:
    """btlib raised ``e``: right where the reference failed too (a corrupted field: named, at load), or where
    the case drew a field outside btlib's documented support and the message names it."""
    RUN["refused"] += 1
    bad = case.model.corrupt
    if isinstance(ref, Exception):
        # btlib must name the corrupted field at load, or another field it may refuse (it may list that one first)
        assert not bad or (at_load and any(f in str(e) for f in case.model.refusable)), (
            f"config.json's {bad[0]}={bad[1]!r} made sentence-transformers fail; btlib "
            f"{'refused' if at_load else 'loaded it, then raised at encode'} without naming it: {type(e).__name__}: {e}")
        return
    assert any(f in str(e) for f in case.model.refusable), (
        f"btlib refused a folder sentence-transformers encodes: {type(e).__name__}: {e}\n"
        f"(it may refuse only by naming one of {case.model.refusable})")


def check_case(case: FolderCase, folders: Folders) -> None:
    """One differential check (the module docstring's rules); AssertionError says what differs."""
    folder = folders.folder(case)
    RUN["cases"] += 1
    ref = _reference(folder, case.texts)
    try:
        model = load_pretrained(folder)
    except (CheckpointError, ValueError, TypeError) as e:
        return _refused(case, ref, e, at_load=True)
    try:
        ours = model.encode(list(case.texts), batch_size=2)
    except (CheckpointError, ValueError, TypeError) as e:
        return _refused(case, ref, e, at_load=False)
    assert not isinstance(ref, Exception), (f"btlib answered where sentence-transformers raised "
                                            f"{type(ref).__name__}: {ref}")
    RUN["compared"] += 1
    _close(ours, ref, "encode vs sentence-transformers")
    ids = model.tokenize(list(case.texts))
    pad = json.loads((folder / "config.json").read_text())["pad_token_id"]
    _close(_hidden_states(model, ids), _transformers_states(folder, ids, pad), "hidden states vs transformers")


@pytest.mark.parametrize("arch", ARCHS)
def test_folders_match_sentence_transformers(arch, folders):
    @FUZZ
    @given(folder_cases(arch))
    def run(case):
        check_case(case, folders)

    run()


def test_fuzz_case_count(capsys):
    """How many folders the fuzzer built and checked in this run (printed with the budget that set it)."""
    with capsys.disabled():
        print(f"\nfolder fuzzer: {RUN['cases']} cases ({RUN['compared']} compared, {RUN['refused']} refused) "
              f"with BTLIB_FUZZ_EXAMPLES={EXAMPLES}")
    if not RUN["cases"]:
        pytest.skip("the fuzz tests did not run in this session")
    assert RUN["cases"] >= FUZZ.max_examples
