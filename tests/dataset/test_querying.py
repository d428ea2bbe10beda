"""The recipes of docs/querying.md, run as written on real recordings: each recipe's pandas and
DuckDB forms give the same table, and that table agrees with the workload that was recorded."""

from __future__ import annotations

import ast
import datetime as dt
import math
import re
import socket
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, Recorded
from fleet_data import copy_recording, recording_day

DOC = ROOT / "docs" / "querying.md"
FUNCTION = "leak_malloc"


def doc_recipes(heading: str = "Recipes", langs: tuple[str, ...] = ("python", "sql")) -> dict[str, dict[str, str]]:
    """`### title` sections under `## heading`: {title: {lang: code}}, one block of each language."""
    section = DOC.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    out: dict[str, dict[str, str]] = {}
    for chunk in section.split("\n### ")[1:]:
        title, body = chunk.split("\n", 1)
        blocks = re.findall(r"```(\w+)\n(.*?)```", body, re.S)
        assert sorted(lang for lang, _ in blocks) == sorted(langs), f"{title}: one block of each of {langs}"
        out[title.strip()] = dict(blocks)
    return out


def fleet_recipes() -> dict[str, dict[str, str]]:
    """The fleet recipes: pyarrow (python), DuckDB (sql) and Spark (pyspark) forms."""
    return doc_recipes("Fleet recipes", ("python", "sql", "pyspark"))


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
    recipes, fleet = doc_recipes(), fleet_recipes()
    assert set(recipes) == set(CHECKS) and set(fleet) == set(FLEET_CHECKS)
    # no runnable block outside the recipes, where nothing would run it
    blocks = re.findall(r"```(python|sql|pyspark)\n", DOC.read_text())
    assert len(blocks) == 2 * len(recipes) + 3 * len(fleet)


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


# --- fleet recipes: many hosts under one schema-6 prefix, pyarrow, DuckDB and Spark -------------------

@dataclass
class Prefix:
    root: Path                  # PREFIX: <table>/host=<h>/date=<d>/
    deploy: str                 # DEPLOY: the start of the day after the recordings' day


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, leaky, leaky_grown) -> Prefix:
    """Three hosts of real recordings: web-1 and web-2 ran `leaky` on day 0 and, after the deploy,
    `leaky_grown` (leak_malloc 4x, leak_posix_memalign new, leak_calloc gone) on day 1; web-3
    ran `leaky` on day 1."""
    root = tmp_path_factory.mktemp("prefix")
    later = 1 + (recording_day(leaky.out) - recording_day(leaky_grown.out)).days    # day 1 of leaky's days
    for host in ("web-1", "web-2"):
        copy_recording(leaky.out, root, host, 0)
        copy_recording(leaky_grown.out, root, host, later)
    copy_recording(leaky.out, root, "web-3", 1)
    return Prefix(root, f"{recording_day(leaky.out) + dt.timedelta(days=1)}T00:00:00Z")


@pytest.fixture(scope="module")
def spark():
    """One local Spark session for the module (the recipes' getOrCreate() returns it)."""
    from pyspark.sql import SparkSession
    session = (SparkSession.builder.master("local[1]").appName("allocsampler-recipes")
               .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
               .config("spark.sql.shuffle.partitions", "1").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def fleet_rows(root: Path, table: str) -> pd.DataFrame:
    """Every file of a table read on its own (no dataset, no partition discovery; `host` from its
    host= directory)."""
    files = sorted(root.glob(f"{table}/host=*/date=*/*.parquet"))
    df = pd.concat([pq.ParquetFile(f).read().to_pandas().assign(host=f.parent.parent.name.split("=", 1)[1])
                    for f in files], ignore_index=True)
    return df.astype({c: str for c in ("host", "recording_id", "source") if c in df})


def running_malloc(root: Path) -> pd.DataFrame:
    o = fleet_rows(root, "outstanding")
    return o[(o["source"] == "malloc") & ~o["exiting"].fillna(False).astype(bool)]


def check_growing(df: pd.DataFrame, fx: Prefix) -> None:
    o = fleet_rows(fx.root, "outstanding")
    o = o[o["source"] == "malloc"]
    growth: dict[int, float] = {}
    grew_on: dict[int, int] = {}
    for (sid, _), g in o.groupby(["stack_id", "host"]):
        d = g["allocated_bytes"].sum() - g["freed_bytes"].sum()
        growth[sid] = growth.get(sid, 0.0) + d
        grew_on[sid] = grew_on.get(sid, 0) + (d >= 1)
    top = sorted((s for s, v in growth.items() if v >= 1), key=lambda s: (-growth[s], s))[:10]
    assert list(df["stack_id"]) == top
    assert list(df["growth_bytes"]) == pytest.approx([growth[s] for s in top], rel=1e-9)
    assert list(df["hosts"]) == [grew_on[s] for s in top]
    # the leaks: leak_malloc on every host, leak_posix_memalign only where leaky_grown ran
    sites = df.set_index(df["summary"].str.split(" ").str[0])["hosts"]
    assert sites["leak_malloc"] == 3 and sites["leak_posix_memalign"] == 2 and "churn" not in sites


def check_deploy(df: pd.DataFrame, fx: Prefix) -> None:
    o = running_malloc(fx.root)
    stacks = fleet_rows(fx.root, "stacks").drop_duplicates("stack_id").set_index("stack_id")["summary"]
    deploy = pd.Timestamp(fx.deploy)
    held: dict[tuple[str, str], float] = {}
    for _, g in o.groupby(["host", "recording_id", "pid"]):
        for side, rows in (("before", g[g["ts"] < deploy]), ("after", g[g["ts"] >= deploy])):
            for sid, b in rows[rows["ts"] == rows["ts"].max()].groupby("stack_id")["outstanding_bytes"].sum().items():
                key = (stacks[sid], side)
                held[key] = held.get(key, 0.0) + b
    got = df.set_index("summary")
    assert set(got.index) == {s for s, _ in held}
    for summary, row in got.iterrows():
        assert row["before_bytes"] == pytest.approx(held.get((summary, "before"), 0.0), rel=1e-9)
        assert row["after_bytes"] == pytest.approx(held.get((summary, "after"), 0.0), rel=1e-9)
    assert list(df["change_bytes"]) == sorted(df["change_bytes"], reverse=True)
    first = df.iloc[0]      # leak_malloc held 4x more after the deploy
    assert first["summary"].startswith("leak_malloc (") and first["after_bytes"] > 2 * first["before_bytes"] > 0


FLEET_CHECKS: dict[str, Callable[[pd.DataFrame, Prefix], None]] = {
    "Top growing stacks across hosts": check_growing,
    "Before and after a deploy": check_deploy,
}


def spark_frame(df) -> pd.DataFrame:
    return pd.DataFrame([r.asDict() for r in df.collect()], columns=df.columns)


@pytest.mark.bpf
@pytest.mark.parametrize("title", list(FLEET_CHECKS))
def test_fleet_recipe(title, prefix, spark):
    recipe = fleet_recipes()[title]

    def concrete(code: str) -> str:
        return code.replace("PREFIX", str(prefix.root)).replace("DEPLOY", prefix.deploy)

    py = run_python(concrete(recipe["python"]))
    results = {"sql": run_sql(concrete(recipe["sql"])), "pyspark": spark_frame(run_python(concrete(recipe["pyspark"])))}
    for lang, df in results.items():
        assert list(df.columns) == list(py.columns), lang
        pd.testing.assert_frame_equal(normalized(py), normalized(df), check_dtype=False, rtol=1e-9, obj=lang)
    FLEET_CHECKS[title](py.reset_index(drop=True), prefix)
