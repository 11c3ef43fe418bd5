"""Which model families btlib loads, what each is checked against, how closely, at which precisions: one registry.

    from btlib.pretrained import FAMILIES, coverage_table
    print(coverage_table())          # the markdown table docs/families.md carries (its "model families" block)

:data:`FAMILIES` is the one list: a family added to btlib adds one :class:`Family` row here (its model_types and
loader are what btlib.load_pretrained looks up: config.json is read once, its model_type names the row), docs/families.md's
table is regenerated from it (``python .ci/workbook.py readme``), and tests/test_coverage.py fails while
docs/families.md's block differs from :func:`coverage_table` or a row names a test file that does not exist.
``fp32_tol`` is the bound the row's tests assert (max |btlib - reference| over the reference's max |value|),
so the figure in the table is the one a test holds; the tests added with a row read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .architectures.bert import load_bert
from .architectures.modernbert import load_modernbert_plan
from .architectures.mpnet import load_mpnet
from .architectures.qwen3 import load_qwen3
from .architectures.rotary_bert import load_rotary_bert

__all__ = ["Family", "FAMILIES", "family", "family_of", "coverage_table"]


@dataclass(frozen=True)
class Family:
    """One row: name, what it loads (config.json's model_type or architectures), the outside reference(s) it is
    compared with, the fp32 bound its tests assert, the precisions offered with how they are checked, the tests;
    model_types: the config.json model_type values btlib.load_pretrained sends to ``load``, the family's loader
    ``load(plan, *, expected_sha256, config)`` (plan: the read folder, btlib.pretrained.folders.st_folder; config:
    config.json's (dict, path), read once by load_pretrained). A row with no model_types has its own entry point
    (the cross-encoder heads: btlib.load_reranker)."""

    name: str
    loads: str
    reference: str
    fp32_tol: float
    precisions: str
    tests: tuple[str, ...]
    model_types: tuple[str, ...] = ()
    load: Callable | None = None


_BERT_LOW = ("fp32, bf16, int8; bf16: cosine > 0.999 to fp32, error <= 2x transformers' own bf16; int8: cosine >= 0.99 "
             "(tiny random folders; all-MiniLM-L6-v2: cosine >= 0.995)")
_ST = "SentenceTransformer.encode (pooled as the folder says)"
_ROTARY_LOW = "fp32, bf16; bf16: cosine > 0.999, error <= 2x transformers' own bf16 (int8: not offered)"

FAMILIES: tuple[Family, ...] = (
    Family("bert", 'model_type "bert"', f"BertModel last_hidden_state; {_ST}; pairs with token types", 1e-5, _BERT_LOW,
           ("tests/test_fuzz_folders.py", "tests/test_pairs.py", "tests/test_pretrained.py", "tests/test_families.py",
            "tests/test_pretrained_precision.py", "tests/test_int8.py"),
           model_types=("bert",), load=load_bert),
    Family("roberta", 'model_type "roberta"', f"RobertaModel last_hidden_state; {_ST}; pairs", 1e-5, _BERT_LOW,
           ("tests/test_fuzz_folders.py", "tests/test_pairs.py", "tests/test_pretrained.py", "tests/test_families.py"),
           model_types=("roberta",), load=load_bert),
    Family("xlm-roberta", 'model_type "xlm-roberta"', f"XLMRobertaModel last_hidden_state; {_ST}; pairs", 1e-5,
           _BERT_LOW, ("tests/test_fuzz_folders.py", "tests/test_pairs.py", "tests/test_pretrained.py",
                       "tests/test_families.py"),
           model_types=("xlm-roberta",), load=load_bert),
    Family("distilbert", 'model_type "distilbert"', "DistilBertModel last_hidden_state, mean-pooled; pairs", 1e-5,
           _BERT_LOW, ("tests/test_pretrained.py", "tests/test_pairs.py", "tests/test_families.py"),
           model_types=("distilbert",), load=load_bert),
    Family("camembert", 'model_type "camembert"', f"CamembertModel last_hidden_state; {_ST}; pairs", 1e-5, _BERT_LOW,
           ("tests/test_families.py",),
           model_types=("camembert",), load=load_bert),
    Family("electra", 'model_type "electra" (embedding_size = or != hidden_size)',
           f"ElectraModel last_hidden_state; {_ST}; pairs with token types", 1e-5, _BERT_LOW, ("tests/test_families.py",),
           model_types=("electra",), load=load_bert),
    Family("modernbert", 'model_type "modernbert"', f"ModernBertModel last_hidden_state (eager, sdpa); {_ST}", 1e-5,
           "fp32, bf16; bf16: cosine > 0.999, error <= 2x transformers' own bf16 (int8: not offered)",
           ("tests/test_modernbert.py", "tests/test_fuzz_folders.py"),
           model_types=("modernbert",), load=load_modernbert_plan),
    Family("nomic_bert", 'model_type "nomic_bert" (the published GPT-2 fields, or transformers\' own)',
           "NomicBertModel last_hidden_state (RoPE bases 1000 and 10000; published and transformers-saved folders); "
           "encode mean / CLS pooled, pairs with token types, a sentence-transformers folder with prompts", 1e-5,
           _ROTARY_LOW, ("tests/test_rotary_bert.py",),
           model_types=("nomic_bert",), load=load_rotary_bert),
    Family("gte", 'model_type "new" (GTE v1.5\'s remote-code fields) or "gte" (transformers\' fields, or the remote '
           "code's)", "GteModel last_hidden_state (rope_theta as given; NTK-scaled RoPE as the remote code computes it, "
           "set into GteModel)", 1e-5, _ROTARY_LOW, ("tests/test_rotary_bert.py",),
           model_types=("new", "gte"), load=load_rotary_bert),
    Family("mpnet", 'model_type "mpnet" (MPNetModel, MPNetForMaskedLM)',
           f"MPNetModel last_hidden_state (lengths 1 to 200, past the bias table's max_distance 128); {_ST}, "
           "paths packed and slow (fastpath, fastpath_nested refused)", 1e-5,
           "fp32, bf16, int8; bf16: cosine > 0.999, error <= 2x transformers' own bf16; int8: cosine >= 0.99 "
           "(tiny random folders)", ("tests/test_mpnet.py",),
           model_types=("mpnet",), load=load_mpnet),
    Family("qwen3", 'model_type "qwen3" (Qwen3Model, Qwen3ForCausalLM: Qwen3-Embedding\'s folders)',
           "Qwen3Model last_hidden_state per sequence (causal; GQA and not; head_dim = and != hidden / heads; with and "
           "without biases; lengths 1, 7, 97 packed; Qwen3Model, Qwen3ForCausalLM and Qwen3-Embedding's config fields); "
           "a sentence-transformers folder: last-token pooled, normalised, query prompt (instruct), also against a "
           "left-padded batch", 1e-5,
           "fp32, bf16; bf16: cosine > 0.999, error <= 2x transformers' own bf16 (int8: not offered)",
           ("tests/test_qwen3.py",),
           model_types=("qwen3",), load=load_qwen3),
    Family("cross-encoder heads", "architectures Bert / Roberta / XLMRoberta / Camembert / Electra / "
           "DistilBert ForSequenceClassification: btlib.load_reranker",
           "*ForSequenceClassification logits (num_labels 1 and 3, truncated pairs); CrossEncoder.predict / rank", 1e-5,
           "fp32, bf16, int8; bf16: error <= 2x transformers' own bf16 logits; int8: cosine >= 0.99 over the logits",
           ("tests/test_reranker.py",)),
)


def family_of(model_type: object) -> Family | None:
    """The row whose loader takes config.json's ``model_type`` (None: no row does; the BERT loader then refuses it by name)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def family(name: str) -> Family:
    """The row named ``name``; KeyError listing the names for any other."""
    for f in FAMILIES:
        if f.name == name:
            return f
    raise KeyError(f"no family {name!r}; btlib.pretrained.FAMILIES has {[f.name for f in FAMILIES]}")


def coverage_table(speeds: Mapping[str, str] | None = None) -> str:
    """FAMILIES as a markdown table (no trailing newline): the text between docs/families.md's "model families" markers.

    ``speeds``: family -> its measured speed against transformers, as text (docs/families.md's come from a notebook's
    committed run, read by .ci/workbook_readme.py); adds that column, naming the command for families without one.
    """
    head = ["family", "loads", "checked against", "fp32 parity", "precisions", "tests"]
    if speeds is not None:
        head.append("packed vs transformers (workbook corpus, batch 32)")
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for f in FAMILIES:
        tests = ", ".join(f"`{t.removeprefix('tests/')}`" for t in f.tests)
        cells = [f.name, f.loads, f.reference, f"max abs diff <= {f.fp32_tol:g} x reference scale", f.precisions, tests]
        if speeds is not None:
            cells.append(speeds.get(f.name) or ("its encoder family's (the head adds O(d^2) flops per pair)" if f.name ==
                         "cross-encoder heads" else f"not timed in notebook 07: `python -m btlib.bench run family_speed "
                         f"--set \"x_vals=['{f.name}']\"`"))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)
