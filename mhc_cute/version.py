"""The package's version (one place: the tuned tables' keys carry it, ``pyproject.toml`` repeats it) and the
installed versions of the distributions it runs on."""

__version__ = "0.2.0"


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist`` (e.g. ``"apache-tvm-ffi"``), or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"
