"""Attention kernels: the registry, PyTorch's own kernels, btlib's CPU and GPU kernels, and the one check."""

from . import choice
from .check import CheckResult, check
from .registry import CpuRun, Kernel, get, kernels, register, relative_error, select, use_ranking

use_ranking(choice.ranking)  # "auto" follows what was measured on this machine (choice.explain says why)

__all__ = ["Kernel", "CpuRun", "CheckResult", "check", "get", "kernels", "register", "relative_error", "select"]
