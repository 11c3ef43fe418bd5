"""Quick mode: small sizes everywhere (notebooks, benchmarks, the device description), for CI.

    BTLIB_QUICK=1 pytest --nbval-lax notebooks/      every notebook in seconds-to-a-minute each
"""

from __future__ import annotations

import os

__all__ = ["quick_mode"]


def quick_mode() -> bool:
    """True when BTLIB_QUICK is set to 1/true/yes: notebooks and benchmarks use their small sizes (CI)."""
    return os.environ.get("BTLIB_QUICK", "").lower() in ("1", "true", "yes")
