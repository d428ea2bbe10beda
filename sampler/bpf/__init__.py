"""The BPF C sources (bcc dialect): the top-level `bpf/` of a checkout, which an installed
package carries as `sampler/bpf/programs/` (copied there when the wheel is built: setup.py)."""

from pathlib import Path

_HERE = Path(__file__).resolve().parent
_PACKAGED = _HERE / "programs"
_CHECKOUT = _HERE.parents[1] / "bpf"


def source_dir() -> Path:
    """Where the sources are: the package's copy when it has one, else the checkout's."""
    return _PACKAGED if _PACKAGED.is_dir() else _CHECKOUT


def source(name: str) -> str:
    """Text of one BPF source file (`abi.h`, `common.h`, `alloc.bpf.c`, ...)."""
    return (source_dir() / name).read_text()
