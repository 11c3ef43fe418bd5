"""btlib.nested: jagged nested tensors in and out of the packed format, checked against plain loops."""

import logging
import warnings

import pytest
import torch

from btlib.nested import nested_to_packed, nested_to_padded, packed_to_nested, padded_to_nested, quiet_jagged

LENGTHS = [[1], [97], [3, 0, 5], [1, 97, 2], [0, 0]]  # T = 1, T = 97, a fully padded row, batch 1, all empty


def _padded(lengths, d=8, fill=0.0):
    """A (B, T, d) batch with ``fill`` past each length, T = max(lengths) (at least 1)."""
    T = max(max(lengths), 1)
    x = torch.randn(len(lengths), T, d)
    for b, L in enumerate(lengths):
        x[b, L:] = fill
    return x


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_padded_round_trip_against_a_loop(lengths):
    x = _padded(lengths)
    nt = padded_to_nested(x, torch.tensor(lengths))
    assert nt.is_nested and nt.layout == torch.jagged and nt.size(0) == len(lengths)
    for b, L in enumerate(lengths):  # sequence b of the nested tensor is x[b, :L], nothing more
        assert torch.equal(nt[b], x[b, :L])
    tokens, cu, max_seqlen = nested_to_packed(nt)
    assert torch.equal(tokens, torch.cat([x[b, :L] for b, L in enumerate(lengths)]))
    assert cu.dtype == torch.int32 and cu.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]
    assert max_seqlen == max(lengths)
    assert torch.equal(nested_to_padded(nt), x[:, :max(lengths)])  # all empty: (B, 0, d)


def test_packed_to_nested_shares_storage_and_keeps_trailing_dims():
    tokens = torch.randn(101, 4, 16)  # (total, H, D)
    cu = torch.tensor([0, 1, 98, 98, 101], dtype=torch.int32)  # lengths 1, 97, 0, 3
    nt = packed_to_nested(tokens, cu)
    assert nt.values().data_ptr() == tokens.data_ptr()  # no copy: values() is the token tensor itself
    assert nt.offsets().dtype == torch.int64 and nt.offsets().tolist() == cu.tolist()
    assert nt[1].shape == (97, 4, 16) and torch.equal(nt[3], tokens[98:])
    back, cu_back, max_seqlen = nested_to_packed(nt)
    assert back.data_ptr() == tokens.data_ptr() and torch.equal(cu_back, cu) and max_seqlen == 97


@pytest.mark.parametrize("fill", [0.0, -1.5])
def test_nested_to_padded_pads_to_T_with_fill(fill):
    lengths = [1, 97, 0]
    x = _padded(lengths, fill=fill)
    nt = padded_to_nested(x, torch.tensor(lengths))
    out = nested_to_padded(nt, T=100, fill=fill)
    ref = torch.full((3, 100, 8), fill)
    ref[:, :97] = x
    assert torch.equal(out, ref)
    assert nested_to_padded(nt, T=torch.tensor(97)).shape == (3, 97, 8)  # a 0-d int tensor is an int


def test_nested_to_padded_refuses_to_truncate_and_bad_T():
    nt = padded_to_nested(_padded([1, 97]), torch.tensor([1, 97]))
    with pytest.raises(ValueError, match=r"T=96 is shorter than the longest sequence \(97\).*Pass T >= 97"):
        nested_to_padded(nt, T=96)
    with pytest.raises(TypeError, match="T must be an int; got float"):
        nested_to_padded(nt, T=97.0)
    with pytest.raises(ValueError, match="T must be >= 0"):
        nested_to_padded(nt, T=-1)


def test_only_jagged_nested_tensors_are_accepted():
    with pytest.raises(TypeError, match="layout=torch.jagged.*got Tensor"):
        nested_to_packed(torch.randn(2, 3, 4))
    with warnings.catch_warnings():  # "The PyTorch API of nested tensors is in prototype stage": once per process
        warnings.simplefilter("ignore")
        strided = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)])
    with pytest.raises(TypeError, match="got a strided nested tensor"):
        nested_to_packed(strided)
    with pytest.raises(TypeError, match="layout=torch.jagged"):
        nested_to_padded(strided)


def test_bad_packed_and_padded_inputs_say_what_to_fix():
    tokens = torch.randn(9, 8)
    with pytest.raises(TypeError, match="cu_seqlens must be int32"):
        packed_to_nested(tokens, torch.tensor([0, 2, 9]))  # int64
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 8 must equal the number of packed tokens \(9\)"):
        packed_to_nested(tokens, torch.tensor([0, 2, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        packed_to_nested(tokens, torch.tensor([0, 5, 2, 9], dtype=torch.int32))
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="lengths must be <= the padded length T=5"):
        padded_to_nested(x, torch.tensor([1, 6]))
    with pytest.raises(ValueError, match="lengths has 3 entries but the batch has B=2"):
        padded_to_nested(x, torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="lengths must be an integer tensor"):
        padded_to_nested(x, torch.tensor([1.0, 2.0]))


def test_quiet_jagged_drops_only_below_error_and_removes_its_filter():
    logger = logging.getLogger("torch.fx._symbolic_trace")
    before = list(logger.filters)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.levelno)

    handler = Keep(logging.DEBUG)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with quiet_jagged():
            logger.warning("is_fx_tracing will return true ...")
            logger.error("a real error")
        logger.warning("after the context")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == [logging.ERROR, logging.WARNING]
    assert logger.filters == before
