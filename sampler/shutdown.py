"""What a process of ours does before it exits, whatever it did."""

from __future__ import annotations

import sys


def release_s3() -> None:
    """pyarrow shuts its S3 client down at exit (atexit); a filesystem object still alive then,
    freed later in the interpreter's teardown, can abort the process after its work is done
    ("terminate called without an active exception", apache/arrow#41087, #39162): the objects
    are collected first, and the client shut down while none is left. Nothing when S3 was not
    imported."""
    fs = sys.modules.get("pyarrow.fs")
    if fs is None or not hasattr(fs, "ensure_s3_finalized"):
        return
    import gc
    gc.collect()
    fs.ensure_s3_finalized()
