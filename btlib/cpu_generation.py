"""A CPU's generation from its family and model numbers: what a reader needs to read a kernel result.

    cpu_generation()   # "Zen 3 (family 25, model 1)" on an AMD EPYC 7003, "Sapphire Rapids (family 6, model 143)", ...

"AMD EPYC" names three generations with different vector units: Zen 3 has AVX2 only, Zen 4 runs AVX-512 in two
256-bit halves and has AVX512_BF16, Zen 5 has full 512-bit units. Which of btlib's kernels wins depends on that, so
every figure the workbook prints names the generation, not the brand. Read from /proc/cpuinfo ("cpu family", "model";
"CPU part" on aarch64); a CPU not in the tables below is named by its numbers alone.
"""

from __future__ import annotations

from .hardware import _cpuinfo, _field

__all__ = ["cpu_generation", "generation"]

# AMD: (family, first model, last model) -> generation (AMD's processor programming references, per family)
_AMD = [(23, 0x00, 0x0F, "Zen"), (23, 0x10, 0x2F, "Zen+"), (23, 0x30, 0xFF, "Zen 2"),
        (25, 0x00, 0x0F, "Zen 3"), (25, 0x10, 0x1F, "Zen 4"), (25, 0x20, 0x5F, "Zen 3"), (25, 0x60, 0x7F, "Zen 4"),
        (25, 0xA0, 0xAF, "Zen 4c"), (26, 0x00, 0xFF, "Zen 5")]
# Intel server parts, family 6: model -> generation
_INTEL = {0x55: "Skylake / Cascade Lake", 0x6A: "Ice Lake", 0x6C: "Ice Lake", 0x8F: "Sapphire Rapids",
          0xCF: "Emerald Rapids", 0xAD: "Granite Rapids", 0xAF: "Sierra Forest"}
# Arm cores ("CPU part"), the ones cloud servers use
_ARM = {"0xd0c": "Neoverse N1", "0xd40": "Neoverse V1", "0xd49": "Neoverse N2", "0xd4f": "Neoverse V2",
        "0xd8e": "Neoverse N3", "0xd84": "Neoverse V3"}


def generation(vendor: str, family: int | None, model: int | None, part: str = "") -> str | None:
    """The generation's name for these numbers, or None where the tables do not know it.
    generation("AuthenticAMD", 25, 1) -> "Zen 3"; generation("AuthenticAMD", 26, 2) -> "Zen 5"."""
    if part:
        return _ARM.get(part.lower())
    if family is None or model is None:
        return None
    if vendor == "AuthenticAMD":
        return next((name for f, lo, hi, name in _AMD if f == family and lo <= model <= hi), None)
    if vendor == "GenuineIntel" and family == 6:
        return _INTEL.get(model)
    return None


def _int(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def cpu_generation() -> str:
    """"Zen 3 (family 25, model 1)": this CPU's generation and the numbers it was read from; the numbers alone where
    the generation is not known; "" where /proc/cpuinfo says nothing (macOS, Windows)."""
    info = _cpuinfo()
    family, model = _int(_field(info, "cpu family")), _int(_field(info, "model"))
    part = _field(info, "CPU part")
    name = generation(_field(info, "vendor_id"), family, model, part)
    numbers = f"CPU part {part}" if part else (f"family {family}, model {model}" if family is not None else "")
    if name and numbers:
        return f"{name} ({numbers})"
    return name or numbers
