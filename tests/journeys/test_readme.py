"""The README kept honest: every `allocsampler ...` command it shows is run by a journey (the
journeys name each by its README text, tests/journey.py readme_argv, which fails for a text the
README does not show), and the Quickstart keeps its two commands."""

from __future__ import annotations

import re
from pathlib import Path

from journey import README, readme_commands

JOURNEYS = Path(__file__).parent


def journey_sources() -> str:
    return "\n".join(p.read_text() for p in sorted(JOURNEYS.glob("test_*.py")) if p.name != Path(__file__).name) \
        + (JOURNEYS.parent / "journey.py").read_text()


def test_every_readme_command_is_run_by_a_journey():
    commands = readme_commands()
    assert len(commands) >= 10, commands            # the collector still finds them
    sources = journey_sources()
    missing = [c for c in commands if f'"{c}"' not in sources]
    assert not missing, f"README commands that no journey runs (tests/journeys/): {missing}"


def test_the_collector_finds_code_blocks_and_inline_commands():
    text = ("Intro `allocsampler top DIR` here.\n\n    allocsampler record --pid 1   # a comment\n"
            "    other --cmd\n\n```\nallocsampler check\n```\n")
    assert readme_commands(text) == ["allocsampler top DIR", "allocsampler record --pid 1", "allocsampler check"]


def test_the_quickstart_keeps_its_two_commands():
    text = README.read_text()
    quick = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    cmds = [ln.strip().split("#")[0].strip() for ln in quick.splitlines() if re.match(r"    \S", ln)]
    assert cmds == ["bash scripts/demo.sh", "bash scripts/test.sh"], cmds
    assert '"bash", "scripts/demo.sh"' in journey_sources()          # the Quickstart journey runs the demo
