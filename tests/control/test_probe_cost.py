"""The probe-cost calibration's children (sampler/control/probe_cost.py) run isolated, in /: root's
`record` from a directory another user can write imports nothing from it (docs/security.md)."""

from __future__ import annotations

import os
import subprocess

import pytest
from conftest import planted_dir
from journey import ALLOCSAMPLER

pytestmark = pytest.mark.bpf


def test_record_from_a_planted_directory_imports_nothing_from_it(tmp_path, bpf_ready):
    """`record` calibrates with an empty cache: its children (`python -c`, which put the working
    directory first on sys.path) never import the ctypes/, json/ or multiprocessing/ planted there,
    and the calibration still works. Run as root runs it: the entry point, from that directory."""
    marker = tmp_path / "imported"
    cwd = planted_dir(tmp_path / "cwd", marker)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    r = subprocess.run([ALLOCSAMPLER, "record", "-o", "rec", "-d", "3", "--", "sleep", "2"], cwd=cwd,
                       env={**os.environ, "ALLOCSAMPLER_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(calibrated (" in r.stderr and (cache / "probe-cost.json").exists(), r.stderr[-3000:]
    assert not marker.exists(), marker.read_text()
    assert any((cwd / "rec" / "recordings").rglob("*.parquet"))         # the relative --out, as given
