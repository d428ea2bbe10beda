"""BPF C sources (bcc dialect), shipped as package data."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    """Text of one BPF source file in this directory."""
    return (_HERE / name).read_text()
