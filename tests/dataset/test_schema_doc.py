"""docs/schema.md is generated from the dataset's schema (sampler/dataset/schema.py) by
scripts/gen_schema_doc.py, and names every table."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from sampler.dataset.schema import TABLES


def test_schema_doc_is_generated_from_the_schema():
    doc = (ROOT / "docs" / "schema.md").read_text()
    fresh = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_schema_doc.py"), "--stdout"],
                           capture_output=True, text=True, check=True).stdout
    assert doc == fresh, "docs/schema.md is stale: run scripts/gen_schema_doc.py"
    for t in TABLES.values():
        assert f"## `{t.name}`" in doc
