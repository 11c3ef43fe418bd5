"""Which kernel F.scaled_dot_product_attention runs, and why not the others.

explain.py predicts the backend from torch's own gate functions (:func:`explain_sdpa`);
forced.py runs SDPA under one forced backend (:func:`run_forced`), the independent check;
constraints.py sets the PyTorch 2.0 post's constraint list beside what torch checks today (:func:`constraint_table`).
"""

from .constraints import CONSTRAINTS, Constraint, constraint_table
from .explain import SDPAReport, explain_sdpa
from .forced import BACKENDS, SDPA_OPS, ForcedRun, forced_backend, run_forced, sdpa_ops

__all__ = ["CONSTRAINTS", "Constraint", "constraint_table", "SDPAReport", "ForcedRun", "explain_sdpa", "run_forced", "sdpa_ops", "forced_backend", "SDPA_OPS", "BACKENDS"]
