"""A fleet's findings as a Spark job: `allocsampler analyze URI --engine spark`, or on a session of
one's own:

    from analysis import spark
    from analysis.source import open_source
    found = spark.findings(session, open_source("s3://bucket/allocsampler"))   # FLEET_FINDINGS rows
    spark.top_stacks(found).show()
    spark.hosts_by_oom(found).show()

The driver lists the hosts (the local pool's host= and date= pruning: analysis/source.py). Each
task analyses a run of hosts with `analysis.fleet.analyse_host` in a Python worker (`mapInArrow`)
and reads that host's files through pyarrow's filesystems, so no Hadoop S3 connector is needed.
The task yields the host's rows (analysis/fleet.py FLEET_FINDINGS). Spark's task retries and
speculation replace the pool's failure handling; a host whose files are damaged is one error
row, never a failed job. The rollups across hosts are Spark SQL over those rows. The job only
reads the dataset, so running it again after it was killed gives the same answer.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from analysis import analyze
from analysis.dataset import Dataset
from analysis.findings import Finding
from analysis.fleet import (
    FLEET_FINDINGS,
    HOST_TIMEOUT_S,
    HostResult,
    analyse_host,
    host_result,
    in_root_dir,
    to_records,
)
from analysis.source import Source
from sampler import files
from sampler.errors import EnvironmentProblem
from sampler.text import printable
from sampler.units import fmt_bytes

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

MAX_FAILURES = 4        # attempts of a task (a lost worker, a node gone) before the job fails
TASKS_PER_SLOT = 4      # hosts are dealt into this many tasks per task slot: few enough that a
                        # task's cost (scheduling, a batch through Arrow) is shared by several
                        # hosts, enough that a slow host or a retried task leaves the others work
INSTALL = ("pip install 'allocsampler[spark]' (pyspark) and a Java runtime 17 or later "
           "(apt install openjdk-17-jre-headless, or JAVA_HOME)")


def default_master() -> str:
    """Spark embedded in this process, one task slot per CPU it may run on."""
    return f"local[{len(os.sched_getaffinity(0))},{MAX_FAILURES}]"


def require() -> None:
    """One line naming what to install when pyspark or Java is missing."""
    try:
        import pyspark  # noqa: F401
        from pyspark.sql import DataFrame
    except ImportError:
        raise EnvironmentProblem(f"--engine spark needs pyspark, which is not installed: {INSTALL}") from None
    if not hasattr(DataFrame, "mapInArrow") or not hasattr(DataFrame, "toArrow"):
        raise EnvironmentProblem(f"--engine spark needs pyspark 4.0 or later (this one is {pyspark.__version__}): "
                                 f"{INSTALL}")
    home = os.environ.get("JAVA_HOME")
    if not (home and os.access(os.path.join(home, "bin", "java"), os.X_OK)) and shutil.which("java") is None:
        raise EnvironmentProblem(f"--engine spark needs a Java runtime, and none was found: {INSTALL}")


# An embedded master's JVM only moves Arrow batches between the Python workers: compiling it with
# C1 alone and collecting with one thread leaves the two CPUs of a small machine to the analysis.
LOCAL_JVM_OPTIONS = os.environ.get("ALLOCSAMPLER_SPARK_LOCAL_JVM", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")


@contextlib.contextmanager
def session(master: str) -> Iterator[SparkSession]:
    """A Spark session of `master` for one command, stopped after it. Its JVM and Python workers
    start in / with this interpreter: they run as whoever runs us (root on a host), and neither
    takes modules from the working directory (`python -m pyspark.daemon` puts it first)."""
    require()
    from pyspark.sql import SparkSession

    scratch = tempfile.mkdtemp(prefix="allocsampler-spark-")
    builder = (SparkSession.builder.master(master).appName("allocsampler analyze")
               .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
               .config("spark.task.maxFailures", str(MAX_FAILURES)).config("spark.speculation", "true")
               .config("spark.sql.warehouse.dir", os.path.join(scratch, "warehouse"))
               .config("spark.local.dir", scratch)
               .config("spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={scratch} -Dderby.system.home={scratch}"
                       + (f" {LOCAL_JVM_OPTIONS}" if master.startswith("local") else "")))
    python = {}
    if master.startswith("local"):
        # pyspark reads PYSPARK_PYTHON as its context starts: the workers run this interpreter, isolated
        python = {"PYSPARK_PYTHON": _isolated_python(scratch), "SPARK_LOCAL_IP": "127.0.0.1"}    # (a loopback
        python = {k: v for k, v in python.items() if k not in os.environ}                       # host: no warning)
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    try:
        # the JVM (and the Python workers it starts) write their log to a file of the scratch
        # directory, not over the command's output: its stderr is that file from its start
        with in_root_dir(), _environ(python), files.stderr_to(os.path.join(scratch, "spark.log")), _quiet():
            spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        try:
            with _quiet():
                yield spark
        finally:
            with in_root_dir():
                spark.stop()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """pyspark's warning that it has not been tested with this pandas: nothing a user can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
        yield


# Spark starts its Python workers as `PYSPARK_PYTHON -m pyspark.daemon`: this runs them with -I
# (no working directory, no PYTHON* variables on the path: root's commands run from directories
# others can write) and finds pyspark where this interpreter has it, and this code where we found it.
_BOOT = """import os, runpy, sys
sys.path.insert(0, {here!r})
args = sys.argv[1:]
while args and args[0] == "-u":
    args = args[1:]
if len(args) >= 2 and args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    os.execv(sys.executable, [sys.executable, "-I", *args])
"""


def _isolated_python(scratch: str) -> str:
    """An executable in `scratch` (private to root) that runs the workers as _BOOT says."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    boot, run = os.path.join(scratch, "boot.py"), os.path.join(scratch, "python")
    with open(boot, "w") as f:
        f.write(_BOOT.format(here=here))
    with open(run, "w") as f:
        f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "-I" {shlex.quote(boot)} "$@"\n')
    os.chmod(run, 0o700)
    return run


@contextlib.contextmanager
def _environ(added: dict[str, str]) -> Iterator[None]:
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def findings(spark: SparkSession, source: Source, load: Callable[[Source], Dataset] = analyze.load,
             visit: Callable[[str, Dataset, list[Finding]], HostResult] = host_result,
             timeout_s: float | None = HOST_TIMEOUT_S) -> DataFrame:
    """The FLEET_FINDINGS rows of every selected host, each `visit`ed as the local pool does
    (`partial(host_result, report=True)`: each host's terminal report in its row); a host whose
    analysis runs past `timeout_s` is an error row (analysis.fleet.analyse_host)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    hosts = source.hosts()

    def analyse(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            for host in batch.column(0).to_pylist():
                rows = to_records(analyse_host(source, host, visit, load, timeout_s))
                yield pa.RecordBatch.from_pylist(rows, schema=FLEET_FINDINGS)

    tasks = max(1, min(len(hosts), spark.sparkContext.defaultParallelism * TASKS_PER_SLOT))
    names = spark.sparkContext.parallelize([(h,) for h in hosts], tasks)
    return spark.createDataFrame(names, "host string").mapInArrow(analyse, from_arrow_schema(FLEET_FINDINGS))


def collect(found: DataFrame) -> pa.Table:
    """The rows at the driver, in host order (the findings of a fleet are small beside its data):
    sorted there, which costs less than Spark's sort (a sampling job and a shuffle, ~0.8 s here)."""
    return found.toArrow().sort_by([("host", "ascending"), ("record", "ascending"), ("ordinal", "ascending")])


def _view(found: DataFrame) -> str:
    """A temporary view of `found` for the rollups' SQL, kept: `sql("... {found}", found=found)`
    drops its own view after the query is planned, and dropping a view uncaches the persisted
    DataFrame it shows (pyspark 4.3: each rollup ran every host's analysis again, 12 s each for
    100 hosts here)."""
    name = f"allocsampler_findings_{next(_views)}"
    found.createOrReplaceTempView(name)
    return name


_views = itertools.count()


def top_stacks(found: DataFrame, n: int = 10) -> DataFrame:
    """The stacks that grow on the most hosts' processes, fastest first: persistent growth findings
    grouped by their stack signature (frames without addresses: the same code on every host)."""
    return found.sparkSession.sql(
        f"""SELECT stack_signature, count(DISTINCT host) AS hosts, count(*) AS findings,
                  sum(growth_bytes_per_hour) AS growth_bytes_per_hour, sum(outstanding_bytes) AS outstanding_bytes,
                  max_by(summary, growth_bytes_per_hour) AS example
           FROM {_view(found)}
           WHERE record = 'finding' AND kind = 'persistent_growth' AND stack_signature IS NOT NULL
           GROUP BY stack_signature
           ORDER BY growth_bytes_per_hour DESC NULLS LAST, hosts DESC, stack_signature
           LIMIT {int(n)}""")


def hosts_by_oom(found: DataFrame, n: int = 10) -> DataFrame:
    """The hosts whose processes reach their memory limit soonest at their growth's rate."""
    return found.sparkSession.sql(
        f"""SELECT host, min(time_to_oom_hours) AS time_to_oom_hours,
                  min_by(comm, time_to_oom_hours) AS comm, min_by(pid, time_to_oom_hours) AS pid,
                  min_by(kind, time_to_oom_hours) AS kind
           FROM {_view(found)}
           WHERE record = 'finding' AND time_to_oom_hours IS NOT NULL
           GROUP BY host
           ORDER BY time_to_oom_hours, host
           LIMIT {int(n)}""")


def rollups_text(found: DataFrame, n: int = 10) -> str:
    """The two rollups as the CLI prints them after the hosts."""
    lines = ["== across hosts: the stacks that grow on the most hosts, fastest first =="]
    stacks = top_stacks(found, n).collect()
    lines += [f"  {fmt_bytes(r.growth_bytes_per_hour or 0)}/h on {r.hosts} host{'s' * (r.hosts != 1)}"
              f" ({r.findings} finding{'s' * (r.findings != 1)}): {_cut(r.stack_signature)}" for r in stacks] \
        or ["  no persistent growth on any host"]
    lines.append("== across hosts: time to OOM, soonest first ==")
    lines += [f"  {printable(r.host)}: {r.time_to_oom_hours:.1f} h ({r.kind}, {printable(r.comm or '?')}"
              f" pid {r.pid})" for r in hosts_by_oom(found, n).collect()] or ["  no host projected to run out"]
    return "\n".join(lines)


def _cut(text: Any, width: int = 140) -> str:
    s = printable(str(text))
    return s if len(s) <= width else s[: width - 3] + "..."
