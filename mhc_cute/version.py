"""The package version (one place: the tuned tables' keys carry it, ``pyproject.toml`` repeats it)."""

__version__ = "0.2.0"
