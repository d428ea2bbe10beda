"""The recipes of docs/querying.md, run as written on real recordings: each recipe's pandas and
DuckDB forms give the same table, and that table agrees with the workload that was recorded."""

from __future__ import annotations

import ast
import math
import re
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest
from test_pprof import Recorded

DOC = Path(__file__).resolve().parents[1] / "docs" / "querying.md"
FUNCTION = "leak_malloc"


def doc_recipes() -> dict[str, dict[str, str]]:
    """`### title` sections under `## Recipes`: {title: {"python": code, "sql": code}}."""
    section = DOC.read_text().split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, str]] = {}
    for chunk in section.split("\n### ")[1:]:
        title, body = chunk.split("\n", 1)
        blocks = re.findall(r"```(\w+)\n(.*?)```", body, re.S)
        langs = [lang for lang, _ in blocks]
        assert sorted(langs) == ["python", "sql"], f"{title}: one python and one sql block, got {langs}"
        out[title.strip()] = dict(blocks)
    return out


@dataclass
class Fleet:
    root: Path                  # FLEET: one dataset per host (here two recordings of this host)
    a: Recorded                 # DIR
    b: Recorded


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, leaky, leaky_grown) -> Fleet:
    """The session's shared recordings (conftest.py), read in place: `leaky` as DIR (leak_malloc
    32 MiB and leak_calloc 16 MiB held, 32 MiB churned) and `leaky_grown` (leak_malloc 128 MiB,
    leak_posix_memalign 16 MiB held) as a second host, linked under one FLEET directory."""
    root = tmp_path_factory.mktemp("fleet")
    (root / "a").symlink_to(leaky.out, target_is_directory=True)
    (root / "b").symlink_to(leaky_grown.out, target_is_directory=True)
    return Fleet(root, leaky, leaky_grown)


def run_python(code: str) -> pd.DataFrame:
    """Run a block as a notebook cell: its last line is an expression, the result."""
    tree = ast.parse(code)
    last = tree.body.pop()
    assert isinstance(last, ast.Expr), "a recipe ends with the expression it shows"
    ns: dict = {}
    exec(compile(tree, str(DOC), "exec"), ns)
    return eval(compile(ast.Expression(last.value), str(DOC), "eval"), ns)


def run_sql(code: str) -> pd.DataFrame:
    import duckdb
    con = duckdb.connect()
    try:
        with warnings.catch_warnings():     # duckdb's own conversion of time zones uses a deprecated pandas call
            warnings.filterwarnings("ignore", message="The inplace keyword")
            return con.sql(code).df()
    finally:
        con.close()


def normalized(df: pd.DataFrame) -> pd.DataFrame:
    df = df.reset_index(drop=True).copy()
    for c in df.columns:
        if isinstance(df[c].dtype, pd.DatetimeTZDtype):
            df[c] = df[c].dt.tz_convert("UTC")
        elif not pd.api.types.is_numeric_dtype(df[c]):
            df[c] = df[c].astype(str)
    return df.sort_values(list(df.columns), ignore_index=True)


# --- ground truth from the datasets and the workload -----------------------------------------------

def malloc_rows(out: Path) -> pd.DataFrame:
    o = pd.read_parquet(out / "outstanding")
    o = o[o["source"] == "malloc"]
    f = pd.read_parquet(out / "frames")
    site = f[f["depth"] == 0].drop_duplicates("stack_id").set_index("stack_id")["function"]
    return o.assign(site=o["stack_id"].map(site), comm=o["comm"].astype(str))


def at_end(o: pd.DataFrame) -> pd.DataFrame:
    return o[o["ts"] == o.groupby(["recording_id", "pid"], observed=True)["ts"].transform("max")]


def near(est: float, truth: float, se: float, what: str) -> None:
    assert abs(est - truth) <= max(4 * se, 0.02 * truth), \
        f"{what}: {est:.0f} vs truth {truth:.0f} (stderr {se:.0f})"


def check_top(df: pd.DataFrame, fl: Fleet) -> None:
    assert 2 <= len(df) <= 10
    assert df["outstanding_bytes"].is_monotonic_decreasing
    top = df.iloc[0]
    assert top["summary"].startswith("leak_malloc (libleaky.so)") and top["pid"] == fl.a.pid
    near(top["outstanding_bytes"], fl.a.truth["leak_malloc"], top["outstanding_stderr_bytes"], "top stack")
    calloc = df[df["summary"].str.startswith("leak_calloc (")].iloc[0]
    near(calloc["outstanding_bytes"], fl.a.truth["leak_calloc"], calloc["outstanding_stderr_bytes"], "leak_calloc")


def check_function(df: pd.DataFrame, fl: Fleet) -> None:
    (row,) = df.itertuples()
    assert row.pid == fl.a.pid and row.stacks == 1
    near(row.outstanding_bytes, fl.a.truth["leak_malloc"], row.outstanding_stderr_bytes, FUNCTION)
    o = at_end(malloc_rows(fl.a.out))
    assert row.outstanding_bytes == pytest.approx(o.loc[o["site"] == FUNCTION, "outstanding_bytes"].sum())


def check_growth(df: pd.DataFrame, fl: Fleet) -> None:
    o = malloc_rows(fl.a.out)
    site = o.drop_duplicates("stack_id").set_index("stack_id")["site"]
    per_stack = df.groupby("stack_id")[["allocated_bytes", "freed_bytes", "growth_bytes"]].sum()
    per_site = per_stack.groupby(per_stack.index.map(site)).sum()
    last = at_end(o)
    end = last.groupby("site")["outstanding_bytes"].sum()
    for leak in ("leak_malloc", "leak_calloc"):      # a leak's growth is what it holds at the end
        assert per_site.at[leak, "growth_bytes"] == pytest.approx(end[leak], rel=1e-9)
        se = math.sqrt((last.loc[last["site"] == leak, "outstanding_stderr_bytes"] ** 2).sum())
        near(per_site.at[leak, "growth_bytes"], fl.a.truth[leak], se, f"growth of {leak}")
    churn = per_site.loc["churn"]                    # churn: allocated much, grew nothing
    se = math.sqrt((o.loc[o["site"] == "churn", "allocated_stderr_bytes"] ** 2).sum())
    near(churn["allocated_bytes"], fl.a.truth["churn"], se, "churn allocated")
    assert abs(churn["growth_bytes"]) <= 1e-9 * churn["allocated_bytes"]


def check_join(df: pd.DataFrame, fl: Fleet) -> None:
    procs = pd.read_parquet(fl.a.out / "processes").sort_values(["pid", "ts"], ignore_index=True)
    assert len(df) == len(procs) and (df["rss"] > 0).all()
    # the sampled bytes of each snapshot are the recorder's own per-process total
    assert list(df["malloc_bytes"]) == pytest.approx(list(procs["malloc_outstanding_bytes"]), rel=1e-9, abs=1)
    assert list(df["malloc_per_rss"]) == pytest.approx(list(df["malloc_bytes"] / df["rss"]))


def check_hosts(df: pd.DataFrame, fl: Fleet) -> None:
    comms = {str(c) for r in (fl.a, fl.b) for c in pd.read_parquet(r.out / "processes")["comm"]}
    assert set(df["host"]) == {socket.gethostname()} and set(df["comm"]) == comms
    procs = pd.concat([pd.read_parquet(r.out / "processes") for r in (fl.a, fl.b)])
    ends = pd.concat([at_end(malloc_rows(r.out)) for r in (fl.a, fl.b)])
    truth = fl.a.truth["leak_malloc"] + fl.a.truth["leak_calloc"] + fl.b.truth["leak_malloc"] + \
        fl.b.truth["leak_posix_memalign"]
    for row in df.itertuples():
        assert row.peak_rss == procs.loc[procs["comm"].astype(str) == row.comm, "rss"].max()
    row = df[df["comm"] == str(ends["comm"].iloc[0])].iloc[0]
    near(row["final_malloc_bytes"], truth, math.sqrt((ends["outstanding_stderr_bytes"] ** 2).sum()), "fleet")


CHECKS: dict[str, Callable[[pd.DataFrame, Fleet], None]] = {
    "Top stacks now": check_top,
    "Memory held under a function": check_function,
    "Growth by hour": check_growth,
    "Process metrics beside the sampled allocations": check_join,
    "Per-host comparison": check_hosts,
}


def test_every_recipe_is_checked():
    recipes = doc_recipes()
    assert set(recipes) == set(CHECKS)
    # no runnable block outside the recipes, where nothing would run it
    blocks = re.findall(r"```(python|sql)\n", DOC.read_text())
    assert len(blocks) == 2 * len(recipes)


@pytest.mark.bpf
@pytest.mark.parametrize("title", list(CHECKS))
def test_recipe(title, fleet):
    recipe = doc_recipes()[title]

    def concrete(code: str) -> str:
        return code.replace("DIR", str(fleet.a.out)).replace("FLEET", str(fleet.root)).replace("FUNCTION", FUNCTION)

    py = run_python(concrete(recipe["python"]))
    sql = run_sql(concrete(recipe["sql"]))
    assert list(py.columns) == list(sql.columns)
    pd.testing.assert_frame_equal(normalized(py), normalized(sql), check_dtype=False, rtol=1e-9)
    CHECKS[title](py, fleet)
