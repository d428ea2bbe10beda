"""Expected failures: each carries a one-line message naming the cause and the fix.

The CLI prints `allocsampler: error: <message>` and exits with the code; no traceback.
"""

from __future__ import annotations

EXIT_USAGE = 2          # bad arguments
EXIT_ENVIRONMENT = 3    # the machine or the target cannot be recorded


class AllocsamplerError(Exception):
    exit_code = EXIT_ENVIRONMENT


class UsageError(AllocsamplerError):
    exit_code = EXIT_USAGE


class EnvironmentProblem(AllocsamplerError):
    exit_code = EXIT_ENVIRONMENT


class TargetGone(EnvironmentProblem):
    """The target process exited before or while it was being attached."""
