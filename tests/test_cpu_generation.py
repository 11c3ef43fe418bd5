"""btlib.cpu_generation: the generation named from family / model numbers (what AMD EPYC alone does not say)."""

import pytest

from btlib import cpu_generation as cg


@pytest.mark.parametrize("vendor, family, model, part, name", [
    ("AuthenticAMD", 25, 1, "", "Zen 3"),          # EPYC 7003 (Milan): AVX2 only
    ("AuthenticAMD", 25, 17, "", "Zen 4"),         # EPYC 9004 (Genoa): AVX-512 in two halves, AVX512_BF16
    ("AuthenticAMD", 26, 2, "", "Zen 5"),          # EPYC 9005 (Turin)
    ("AuthenticAMD", 23, 49, "", "Zen 2"),         # EPYC 7002 (Rome)
    ("GenuineIntel", 6, 143, "", "Sapphire Rapids"),
    ("GenuineIntel", 6, 207, "", "Emerald Rapids"),
    ("", None, None, "0xd0c", "Neoverse N1"),
    ("AuthenticAMD", 99, 1, "", None),             # unknown numbers: no guess
    ("GenuineIntel", 6, 1, "", None),
])
def test_generation_from_numbers(vendor, family, model, part, name):
    assert cg.generation(vendor, family, model, part) == name


@pytest.mark.parametrize("cpuinfo, want", [
    ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n", "Zen 3 (family 25, model 1)"),
    ("vendor_id\t: AuthenticAMD\ncpu family\t: 99\nmodel\t\t: 7\n", "family 99, model 7"),
    ("processor\t: 0\nCPU part\t: 0xd40\n", "Neoverse V1 (CPU part 0xd40)"),
    ("", ""),
])
def test_cpu_generation_reads_cpuinfo(monkeypatch, cpuinfo, want):
    monkeypatch.setattr(cg, "_cpuinfo", lambda: cpuinfo)
    assert cg.cpu_generation() == want
