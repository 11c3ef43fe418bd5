"""btlib's version: pyproject.toml's, importable from every layer (btlib.__version__, the device line)."""

__version__ = "0.1.0"
