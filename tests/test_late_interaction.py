"""btlib.pretrained.late_interaction: MaxSim on packed token vectors equals a plain padded PyTorch einsum reference.

Checks: odd lengths (1, 97, 3 query tokens; 5, 1, 64, 2 document tokens), with and without normalisation, across
several document blocks (DOC_BLOCK lowered); the /embed_all-shaped list form; a real encoder's token states
(tiny random ModernBERT, its encode_tokens(output="token_embeddings")); and the refusals (an empty sequence, widths
that differ).
"""

import pytest
import torch

import btlib.pretrained.late_interaction as li
from btlib.pretrained.late_interaction import maxsim, maxsim_lists
from serve_helpers import tiny_modernbert


def reference(queries: list[torch.Tensor], docs: list[torch.Tensor], normalize: bool) -> torch.Tensor:
    """Padded ColBERT: (Bq, Tq, D) x (Bd, Td, D) -> einsum, padding masked to -inf before the max, 0 before the sum."""
    f = (lambda x: torch.nn.functional.normalize(x, dim=-1)) if normalize else (lambda x: x)
    Qp = torch.nn.utils.rnn.pad_sequence([f(q) for q in queries], batch_first=True)  # (Bq, Tq, D)
    Dp = torch.nn.utils.rnn.pad_sequence([f(d) for d in docs], batch_first=True)  # (Bd, Td, D)
    qm = torch.nn.utils.rnn.pad_sequence([torch.ones(len(q)) for q in queries], batch_first=True).bool()
    dm = torch.nn.utils.rnn.pad_sequence([torch.ones(len(d)) for d in docs], batch_first=True).bool()
    S = torch.einsum("aid,bjd->abij", Qp, Dp)  # (Bq, Bd, Tq, Td)
    S = S.masked_fill(~dm[None, :, None, :], float("-inf")).amax(-1)  # (Bq, Bd, Tq)
    return S.masked_fill(~qm[:, None, :], 0).sum(-1)


def pack(xs):
    lengths = torch.tensor([len(x) for x in xs])
    return torch.cat(xs), torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("block", [li.DOC_BLOCK, 7])
def test_maxsim_equals_padded_einsum(monkeypatch, normalize, block):
    monkeypatch.setattr(li, "DOC_BLOCK", block)
    torch.manual_seed(0)
    queries = [torch.randn(n, 16) for n in (1, 97, 3)]
    docs = [torch.randn(n, 16) for n in (5, 1, 64, 2)]
    got = maxsim(*pack(queries), *pack(docs), normalize=normalize)
    want = reference(queries, docs, normalize)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item(), rtol=0)
    lists = maxsim_lists([q.tolist() for q in queries], docs, normalize=normalize)  # /embed_all's nested lists
    assert torch.allclose(lists, got, atol=1e-6, rtol=0)


def test_maxsim_of_an_encoders_token_states():
    model = tiny_modernbert(32)
    qt, dt = model.tokens(["w1 w2", "w3"]), model.tokens(["w1 w5 w6 w7", "w3 w3", "w9"])
    Q, D_ = (model.encode_tokens(t, output="token_embeddings") for t in (qt, dt))
    split = lambda h, t: list(h.split(t.lengths()))  # noqa: E731
    got = maxsim(Q, pack(split(Q, qt))[1], D_, pack(split(D_, dt))[1], normalize=True)
    assert torch.allclose(got, reference(split(Q, qt), split(D_, dt), True), atol=1e-5, rtol=0)


def test_refusals():
    with pytest.raises(ValueError, match="one token at least"):
        maxsim(torch.randn(3, 4), torch.tensor([0, 3, 3], dtype=torch.int32), torch.randn(2, 4),
               torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="same width"):
        maxsim(torch.randn(3, 4), torch.tensor([0, 3], dtype=torch.int32), torch.randn(2, 5),
               torch.tensor([0, 2], dtype=torch.int32))
