"""Compile the Triton kernel for a GPU that is not here: ``python -m btlib.kernels.triton.targets [--json] [75 80 90]``.

    compile_for(capability, dtype, head_dim, *, varlen, causal, blocks) -> Compiled

``triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", cc, 32))`` runs
Triton's whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships), no
GPU needed: a real compile check per architecture, plus what the compiler decided: shared memory
per program, and whether it used tensor cores (``mma`` in the PTX; ``wgmma`` is Hopper's).
Needs a process where TRITON_INTERPRET is unset (the interpreter replaces the compiler).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

__all__ = ["Compiled", "compile_for", "ARCHS"]

ARCHS = {75: "T4 (Turing)", 80: "A100 (Ampere)", 90: "H100 (Hopper)"}
_PTR = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}


@dataclass(frozen=True)
class Compiled:
    capability: int
    dtype: str
    head_dim: int
    varlen: bool
    causal: bool
    config: dict
    shared_bytes: int
    tensor_cores: bool  # mma / wgmma instructions in the PTX
    cubin_bytes: int
    seconds: float

    @property
    def fits(self) -> bool:
        from .flash_attn import SHARED_LIMIT

        return self.shared_bytes <= SHARED_LIMIT[self.capability]

    def __str__(self) -> str:
        c = self.config
        return (f"sm_{self.capability} {self.dtype:8s} D={self.head_dim:<3d} {'varlen' if self.varlen else 'padded'} "
                f"{'causal' if self.causal else 'full  '}  Br={c['Br']:<3d} Bc={c['Bc']:<3d} "
                f"stages={c['num_stages']}  shared {self.shared_bytes // 1024:3d} KiB  "
                f"tensor cores: {'yes' if self.tensor_cores else 'no '}  cubin {self.cubin_bytes // 1024} KiB  ({self.seconds:.1f} s)")


def compile_for(capability: int, dtype: torch.dtype = torch.float16, head_dim: int = 64, *, varlen: bool = False,
                causal: bool = False, window: bool = False, bias: int = 0, blocks: dict | None = None) -> Compiled:
    """Compile attn_fwd for sm_<capability> with :func:`block_config`'s tiles, or ``blocks``' overrides
    (e.g. ``{"Br": 64, "Bc": 128}``: powers of 2, as tl.arange needs); no GPU needed.

    window: compile the local-window variant (its reaches stay runtime int32 arguments).
    bias: the position-bias variant, 0 none, 1 ALiBi, 2 table (btlib.position_bias.BIAS_KINDS).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .flash_attn import attn_fwd, block_config

    if not isinstance(attn_fwd, triton.runtime.JITFunction):
        raise RuntimeError("TRITON_INTERPRET=1 is set in this process: the interpreter replaced the compiler. "
                           "Compile in a process without it (python -m btlib.kernels.triton.targets).")
    cfg = {**block_config(head_dim, dtype, capability), **(blocks or {})}
    constexprs = dict(Br=cfg["Br"], Bc=cfg["Bc"], BLOCK_D=cfg["BLOCK_D"], VARLEN=varlen,
                      HAS_LENGTHS=not varlen, CAUSAL=causal, WINDOW=window, BIAS=bias, DOT_FP32=False,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32")
    signature = {name: "i32" for name in attn_fwd.arg_names}  # strides, H, Tq, Tk, D, win_left, win_right, bias_R
    signature.update(Q=_PTR[dtype], K=_PTR[dtype], V=_PTR[dtype], O=_PTR[dtype], Lengths="*i32", CuSeqlens="*i32",
                     Bias="*fp32", qk_scale="fp32")
    signature.update({name: "constexpr" for name in constexprs})
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(attn_fwd, signature, constexprs), target=GPUTarget("cuda", capability, 32),
                       options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    seconds = time.perf_counter() - t0
    ptx = k.asm["ptx"]
    return Compiled(capability, str(dtype).replace("torch.", ""), head_dim, varlen, causal, cfg, k.metadata.shared,
                    "mma." in ptx or "wgmma." in ptx, len(k.asm["cubin"]), seconds)


def main(argv: list[str]) -> int:
    """Compile the padded causal fp16 and the varlen bf16 kernel (D=64) per architecture; --json: one JSON object a line."""
    as_json = "--json" in argv
    for cc in [int(a) for a in argv if a != "--json"] or list(ARCHS):
        for dtype, varlen in ((torch.float16, False), (torch.bfloat16, True)):
            c = compile_for(cc, dtype, 64, varlen=varlen, causal=not varlen)
            line = json.dumps({**asdict(c), "fits": c.fits, "gpu": ARCHS.get(cc, "")}) if as_json else \
                f"{c}  {'fits' if c.fits else 'DOES NOT FIT'} {ARCHS.get(cc, '')}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
