"""Attention kernels: the registry, PyTorch's own kernels, btlib's CPU and GPU kernels, and the one check."""

from .check import CheckResult, check
from .registry import CpuRun, Kernel, get, kernels, register, relative_error, select

__all__ = ["Kernel", "CpuRun", "CheckResult", "check", "get", "kernels", "register", "relative_error", "select"]
