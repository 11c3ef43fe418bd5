"""Attention kernels: the registry, PyTorch's own kernels, btlib's CPU and GPU kernels, and the one check.

The registry imports the providers below on its first use (each registers its kernels when imported).
"""

from . import choice
from .check import CheckResult, check
from .registry import CpuRun, Kernel, get, kernels, register, relative_error, select, use_providers, use_ranking


# The kernel providers, in the order they register; a function each, so that importing btlib.kernels imports none of
# them (the registry calls these on its first use) and an error names the module (the name after "_import_").
def _import_torch_ops() -> None:
    from . import torch_ops  # noqa: F401  PyTorch's own kernels: SDPA, its varlen loop, nested SDPA, the references


def _import_cpu() -> None:
    from .cpu import flash, teaching  # noqa: F401  btlib's C++ CPU kernels, one folder per family (compiled on first call)


def _import_triton() -> None:
    from .triton import ops  # noqa: F401  btlib's Triton kernel (triton itself is imported on the first call)


def _import_cuda() -> None:
    from .cuda import ops  # noqa: F401  btlib's CUDA C++ kernel (built on the first call)


use_providers((_import_torch_ops, _import_cpu, _import_triton, _import_cuda))
use_ranking(choice.ranking)  # "auto" follows what was measured on this machine (choice.explain says why)

__all__ = ["Kernel", "CpuRun", "CheckResult", "check", "get", "kernels", "register", "relative_error", "select"]
