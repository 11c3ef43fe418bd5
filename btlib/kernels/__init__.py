"""Attention kernels: the registry, PyTorch's own kernels, and btlib's CPU and GPU kernels."""

from .registry import Kernel, get, kernels, register, relative_error, select

__all__ = ["Kernel", "get", "kernels", "register", "relative_error", "select"]
