"""Readers of what allocsampler writes that share no code with it: pprof profiles decoded by
protobuf classes that protoc generates from upstream's profile.proto, and HTML pages rendered by
headless Chromium (Debian's, which scripts/setup.sh installs)."""

from __future__ import annotations

import gzip
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"


@dataclass
class Sample:
    frames: list[dict]           # innermost first: function, filename, line, mapping file/build-id, address
    values: dict[str, int]
    labels: dict[str, str | int]


def decode(pb2, path: Path) -> tuple[object, list[Sample]]:
    p = pb2.Profile()
    p.ParseFromString(gzip.decompress(path.read_bytes()))
    s = list(p.string_table)
    assert s[0] == ""
    types = [s[t.type] for t in p.sample_type]
    mappings = {m.id: m for m in p.mapping}
    functions = {f.id: f for f in p.function}
    locations = {loc.id: loc for loc in p.location}
    samples = []
    for smp in p.sample:
        frames = []
        for lid in smp.location_id:
            loc = locations[lid]
            fr: dict = {"address": loc.address, "mapping": None, "build_id": None, "function": None,
                        "filename": None, "line": None}
            if loc.mapping_id:
                m = mappings[loc.mapping_id]
                fr.update(mapping=s[m.filename], build_id=s[m.build_id])
            if loc.line:
                f = functions[loc.line[0].function_id]
                fr.update(function=s[f.name], filename=s[f.filename], line=loc.line[0].line)
            frames.append(fr)
        labels = {s[lb.key]: (s[lb.str] if lb.str else lb.num) for lb in smp.label}
        samples.append(Sample(frames, dict(zip(types, smp.value, strict=True)), labels))
    return p, samples


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"{CHROMIUM} is missing: the report's browser test needs Debian's chromium "
                    "(scripts/setup.sh installs it: apt-get install -y chromium)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
