"""The daemon started by hand from a directory another user can write imports nothing from it: the
interpreters it starts (the probe-cost calibration, the table and name workers, the analysis and
compaction children) are isolated (-I) and start in / (sampler/environ.py, docs/security.md)."""

from __future__ import annotations

import pytest
from conftest import compile_c, planted_dir
from test_daemon import WORK_C, DaemonProc, Target, free_port, wait_for, write_config

pytestmark = pytest.mark.bpf


def test_the_daemon_started_in_a_planted_directory_imports_nothing_from_it(tmp_path, bpf_ready):
    """From a directory with a planted ctypes/, json/ and multiprocessing/, with an empty cache (it
    calibrates): a target is recorded, an analysis child reports, SIGTERM ends it with exit 0, and
    nothing planted was imported."""
    marker = tmp_path / "imported"
    cwd = planted_dir(tmp_path / "cwd", marker)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (tmp_path / "work.c").write_text(WORK_C)
    exe = compile_c(tmp_path / "work.c", tmp_path / "cwd_work")
    port = free_port()
    cfg = write_config(tmp_path / "config.toml", tmp_path / "data", port,
                       targets='[[targets]]\nname = "cwd_work"\ntier = "attach"\n')
    d = DaemonProc(cfg, tmp_path / "data", port, tmp_path / "daemon.log", env={"ALLOCSAMPLER_CACHE_DIR": str(cache)},
                   cwd=cwd)
    t = None
    try:
        d.wait_started()
        t = Target([exe, "leak", "512", "30"], cwd="/")
        t.go()
        wait_for(lambda: (d.target(t.pid) or {}).get("tier") == "attach", 30, "the target recorded")
        wait_for(lambda: d.status()["analysis"].get("exit") == 0, 90, "an analysis child's report")
        assert d.stop() == 0
    finally:
        if t is not None:
            t.kill()
        if d.alive():
            d.proc.kill()
    assert "Traceback" not in d.log(), d.log()
    assert (cache / "probe-cost.json").exists(), d.log()        # calibrated: its children ran
    assert not marker.exists(), marker.read_text()
