"""Stand-ins for ``triton`` and ``triton.language`` where Triton is not installed (it has wheels for Linux x86_64 only).

With them flash_attn.py still imports: its kernel source stays readable, :func:`block_config`
works, and launching the kernel raises :data:`MISSING`, which says why and what still runs.
"""

from __future__ import annotations

MISSING = ("triton is not installed: Triton publishes wheels for Linux x86_64 only (there: pip install 'btlib[gpu]'). "
           "The Triton kernel cannot run here, in the interpreter or on a GPU; btlib's C++ CPU kernels, the CUDA "
           "kernel's CPU emulator and PyTorch's own attention do not need it.")


class _Kernel:
    """What ``@triton.jit`` returns here: the Python function, unrunnable."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(MISSING)

    def __call__(self, *args, **kwargs):
        raise RuntimeError(MISSING)


class _Namespace:
    pass


triton = _Namespace()
triton.jit = _Kernel
triton.cdiv = lambda a, b: -(-a // b)
triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
triton.runtime = _Namespace()
triton.runtime.JITFunction = _Kernel
tl = _Namespace()  # annotations only (tl.constexpr): flash_attn.py does not evaluate them without triton
