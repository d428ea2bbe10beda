"""The daemon's configuration: /etc/allocsampler/config.toml into frozen dataclasses.

Everything is checked at load so that the service refuses to start rather than guess: each problem
raises UsageError with one line naming the key (a dotted path such as `targets[2].tier`), the bad
value and what is allowed. packaging/config.example.toml documents every key and its default.

Targets: within one [[targets]] table the selectors name, regex, cgroup and user combine with AND
(`user = "svc"` + `regex = "python"`: that user's Python processes); `all = true` stands alone.
Tables are tried in file order and the first that matches a process decides its tier.
"""

from __future__ import annotations

import difflib
import ipaddress
import json
import math
import os
import posixpath
import pwd
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sampler.errors import EnvironmentProblem, UsageError
from sampler.proc.process import ProcView
from sampler.units import format_size, parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project allows 3.10, where the same parser is the tomli package
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

DEFAULT_PATH = "/etc/allocsampler/config.toml"

ALWAYS_ON, ATTACH, PRELOAD_AWARE = "always-on", "attach", "preload-aware"
TIERS = (ALWAYS_ON, ATTACH, PRELOAD_AWARE)
ATTACH_MODES = ("auto", "inject", "uprobe")   # how the attach tier attaches (README: Tiers)
COMM_LEN = 15                    # the kernel keeps the first 15 bytes of a process name (TASK_COMM_LEN - 1)
SELECTORS = ("name", "regex", "cgroup", "unit", "user", "all")
UID_MAX = (1 << 32) - 2          # (uid_t)-1 means "no uid"

_SIZE_META = {"size": True}      # dataclass field metadata: to_dict writes these as "512K"


# --- the configuration ----------------------------------------------------------------------------

def cgroup_within(path: str, base: str) -> bool:
    """Is cgroup `path` `base` or below it? Component-wise: a.service does not contain a.service2."""
    path, base = path.strip("/"), base.strip("/")
    return path == base or path.startswith(base + "/")


def system_unit(path: str, unit: str) -> bool:
    """`path` (systemd's cgroup of a process) lies in the system manager's `unit` or below it: the
    unit under slices only. A user's manager (user@UID.service) or a container's scope above it runs
    units of the same name that any user or container can start (systemd-run --user --unit=NAME)."""
    for part in path.strip("/").split("/"):
        if part == unit:
            return True
        if not part.endswith(".slice"):
            return False
    return False


@dataclass(frozen=True)
class Target:
    """One [[targets]] table: which processes (selectors, AND-combined) and how (tier)."""

    tier: str = ATTACH
    name: str | None = None                  # exact process name (comm)
    regex: re.Pattern[str] | None = None     # searched in the command line
    cgroup: str | None = None                # below the cgroup v2 root, no leading slash
    unit: str | None = None                  # a systemd unit (its processes and any cgroup below it)
    user: str | None = None                  # as written: a user name or a uid
    uid: int | None = None                   # `user` resolved
    all: bool = False
    exclude: re.Pattern[str] | None = None   # searched in the command line; wins over the selectors
    children: bool = False                   # a selected process's forks are recorded from their fork

    def matches(self, proc: ProcView) -> bool:
        if not self.all:
            if self.name is not None and proc.comm != self.name:
                return False
            if self.regex is not None and not self.regex.search(proc.cmdline):
                return False
            if self.uid is not None and proc.uid != self.uid:
                return False
            if self.cgroup is not None and not cgroup_within(proc.cgroup_path, self.cgroup):
                return False
            if self.unit is not None and not system_unit(proc.systemd_path, self.unit):
                return False
        return self.exclude is None or not self.exclude.search(proc.cmdline)

    def describe(self) -> str:
        """A short label for logs and `allocsampler status`, e.g. `cgroup=system.slice/a.service`."""
        parts = ["all"] if self.all else []
        parts += [f"{k}={v}" for k, v in self._selectors().items() if k != "all"]
        if self.exclude is not None:
            parts.append(f"exclude={self.exclude.pattern}")
        if self.children:
            parts.append("children")
        return " ".join(parts)

    def _selectors(self) -> dict[str, Any]:
        sel = {"name": self.name, "regex": self.regex.pattern if self.regex else None,
               "cgroup": self.cgroup, "unit": self.unit, "user": self.user, "all": self.all or None}
        return {k: v for k, v in sel.items() if v is not None}

    def to_dict(self) -> dict[str, Any]:
        d = self._selectors()
        d["tier"] = self.tier
        if self.exclude is not None:
            d["exclude"] = self.exclude.pattern
        if self.children:
            d["children"] = True
        return d


@dataclass(frozen=True)
class DaemonConfig:
    data_dir: str = "/var/lib/allocsampler"
    interval_s: float = 10                                     # snapshot interval
    sample_bytes: int = field(default=512 << 10, metadata=_SIZE_META)   # mean bytes between samples
    attach_mode: str = "auto"                                  # attach tier: inject, else uprobes
    python_objects: bool = False                               # inject tier: CPython's object allocator
    cpu_budget_percent: float = 3                              # governor: probe cost per target process
    max_samples_per_s: int = 2000                              # per process: its sample mean rises above
    vm_events_per_s: int = 2000                                # per process: unsampled syscall events sent
    fault_period: int = 61                                     # always-on tier: one page fault in N
    max_rss: int = field(default=256 << 20, metadata=_SIZE_META)        # the daemon's own memory bound
    cpu_percent: float = 10                                    # the daemon's own CPU budget (of one CPU)
    rescan_s: float = 5                                        # target discovery period
    max_targets: int = 1000                                    # processes recorded at once (BPF maps: 4096)


@dataclass(frozen=True)
class RetentionConfig:
    max_bytes: int = field(default=10 << 30, metadata=_SIZE_META)
    max_age_days: float = 14
    compact_after_s: float = 3600
    min_free_bytes: int = field(default=256 << 20, metadata=_SIZE_META)  # writing stops below this free space


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    listen: str = "127.0.0.1:9464"

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def loopback_only(self) -> bool:
        return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback


@dataclass(frozen=True)
class AnalysisConfig:
    every_s: float = 300
    window_s: float = 3600                  # the recent data each analysis reads
    pre_oom: bool = True
    pre_oom_fraction: float = 0.9           # of the cgroup memory limit
    pre_oom_sample_bytes: int = field(default=64 << 10, metadata=_SIZE_META)
    pre_oom_window_s: float = 60


@dataclass(frozen=True)
class UploadConfig:
    """[upload]: ship closed files to an object store (sampler/service/upload.py). Absent: nothing
    is uploaded and compaction, retention and status are as without it."""
    uri: str                                # s3://BUCKET[/PREFIX] or file:///PATH
    endpoint: str | None = None             # http(s)://HOST[:PORT] of an S3-compatible store
    region: str | None = None               # else the AWS SDK's (AWS_REGION, ~/.aws/config, ...)
    interval_s: float = 60                  # between upload runs while they succeed
    timeout_s: float = 300                  # one upload run (a child process) at most
    retries: int = 3                        # attempts per request (the S3 client's own backoff)
    backoff_max_s: float = 900              # after failures: waits double up to this (with jitter)
    # not yet uploaded data kept at most (parse sets it: default half of retention.max_bytes)
    max_backlog_bytes: int = field(default=0, metadata=_SIZE_META)


@dataclass(frozen=True)
class Config:
    targets: tuple[Target, ...]
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    upload: UploadConfig | None = None
    source: str = field(default="", compare=False)   # the file it was read from

    def target_for(self, proc: ProcView) -> Target | None:
        """The first target that selects `proc` (file order), None when none does."""
        return next((t for t in self.targets if t.matches(proc)), None)

    def to_dict(self) -> dict[str, Any]:
        """The effective configuration in the file's shape (parse(to_dict()) gives it back)."""
        d = {"daemon": _section_dict(self.daemon), "targets": [t.to_dict() for t in self.targets],
             "retention": _section_dict(self.retention), "metrics": _section_dict(self.metrics),
             "analysis": _section_dict(self.analysis)}
        if self.upload is not None:
            d["upload"] = _section_dict(self.upload)
        return d


def _section_dict(section: Any) -> dict[str, Any]:
    return {f.name: format_size(v) if f.metadata.get("size") else v
            for f in fields(section) if (v := getattr(section, f.name)) is not None}


# --- checking values ------------------------------------------------------------------------------

class _Bad(Exception):
    """A value is not allowed; the argument says what is ("one of a, b, c")."""


def _show(v: Any) -> str:
    """A value as TOML would write it, on one line."""
    if isinstance(v, bool):
        s = "true" if v else "false"
    elif isinstance(v, str):
        s = json.dumps(v, ensure_ascii=False)
    elif isinstance(v, dict):
        s = "{ " + ", ".join(f"{k} = {_show(x)}" for k, x in v.items()) + " }" if v else "{}"
    elif isinstance(v, list):
        s = "[" + ", ".join(_show(x) for x in v) + "]"
    elif hasattr(v, "isoformat"):
        s = v.isoformat()
    else:
        s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _num(v: float) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _number(lo: float, hi: float, *, integer: bool = False, lo_open: bool = False,
            hi_open: bool = False) -> Callable[[Any], float]:
    kind = "an integer" if integer else "a number"
    if lo_open or hi_open:
        expected = f"{kind} {'>' if lo_open else '>='} {_num(lo)} and {'<' if hi_open else '<='} {_num(hi)}"
    else:
        expected = f"{kind} from {_num(lo)} to {_num(hi)}"

    def conv(v: Any) -> float:
        # bool is an int in Python, but `interval_s = true` is a mistake
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)):
            raise _Bad(expected)
        if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
            raise _Bad(expected)
        return v
    return conv


def _size(lo: int, hi: int) -> Callable[[Any], int]:
    expected = f"a size from {format_size(lo)} to {format_size(hi)}, like 512K, 64M or 10G (powers of 1024)"

    def conv(v: Any) -> int:
        n = v if isinstance(v, int) and not isinstance(v, bool) else parse_size(v) if isinstance(v, str) else None
        if n is None or not lo <= n <= hi:
            raise _Bad(expected)
        return n
    return conv


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise _Bad("true or false")
    return v


def _abs_path(v: Any) -> str:
    if not isinstance(v, str) or not v.startswith("/") or "\0" in v:
        raise _Bad("an absolute path, e.g. /var/lib/allocsampler")
    return posixpath.normpath(v)


def _listen(v: Any) -> str:
    expected = ("HOST:PORT with an IP address (IPv6 in brackets) or localhost and a port from 1 to 65535, "
                "e.g. 127.0.0.1:9464 or [::1]:9464")
    if not isinstance(v, str):
        raise _Bad(expected)
    host, _, port = v.rpartition(":")
    if not port.isascii() or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _Bad(expected)
    try:
        if host.startswith("[") and host.endswith("]"):
            ipaddress.IPv6Address(host[1:-1])
        elif host != "localhost":
            ipaddress.IPv4Address(host)      # an unbracketed IPv6 address fails here, on purpose
    except ValueError:
        raise _Bad(expected) from None
    return f"{host}:{int(port)}"


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def conv(v: Any) -> str:
        if v not in options or not isinstance(v, str):
            raise _Bad("one of " + ", ".join(options))
        return v
    return conv


def _regex(v: Any) -> re.Pattern[str]:
    if not isinstance(v, str):
        raise _Bad("a regular expression (Python re syntax) as a string")
    try:
        return re.compile(v)
    except re.error as e:
        raise _Bad(f"a valid regular expression (Python re syntax): {e}") from None


def _comm(v: Any) -> str:
    if not isinstance(v, str) or not v or "\n" in v:
        raise _Bad("a process name as in /proc/PID/comm, e.g. \"postgres\"")
    if len(v.encode()) > COMM_LEN:
        raise _Bad(f"a process name of at most {COMM_LEN} bytes (the kernel truncates longer names; "
                   f"select on the command line with regex instead)")
    return v


_UNIT = re.compile(r"[A-Za-z0-9:_.\\@-]{1,250}\.(service|scope|slice)")


def _unit(v: Any) -> str:
    if not isinstance(v, str) or not _UNIT.fullmatch(v.strip()):
        raise _Bad("a systemd unit name such as postgresql@15-main.service (a .service, .scope or .slice)")
    return v.strip()


def _cgroup(v: Any) -> str:
    expected = "a cgroup v2 path such as system.slice/NAME.service (all = true selects every process)"
    if not isinstance(v, str):
        raise _Bad(expected)
    path = v.strip()
    for mount in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):   # the hierarchy's mount point, if given
        if path == mount or path.startswith(mount + "/"):
            path = path[len(mount):]
            break
    parts = [p for p in path.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts) or "\0" in path:
        raise _Bad(expected)
    return "/".join(parts)


def _user(v: Any) -> tuple[str, int]:
    """(as written, uid). Names are resolved now: a typo must not select nobody, silently."""
    if isinstance(v, int) and not isinstance(v, bool):
        if not 0 <= v <= UID_MAX:
            raise _Bad(f"a user name or a uid from 0 to {UID_MAX}")
        return str(v), v
    if not isinstance(v, str) or not v:
        raise _Bad("a user name or a uid")
    if v.isascii() and v.isdigit():
        return _user(int(v))
    try:
        return v, pwd.getpwnam(v).pw_uid
    except KeyError:
        raise _Bad("a user name known to this host (getent passwd NAME) or a numeric uid") from None


_DAEMON: dict[str, Callable[[Any], Any]] = {
    "data_dir": _abs_path,
    "interval_s": _number(1, 3600),
    "sample_bytes": _size(1, 1 << 30),
    "attach_mode": _choice(ATTACH_MODES),
    "python_objects": _bool,
    "cpu_budget_percent": _number(0, 100),
    "max_samples_per_s": _number(0, 1_000_000, integer=True),
    "vm_events_per_s": _number(0, 1_000_000, integer=True),
    "fault_period": _number(1, 1 << 20, integer=True),
    "max_rss": _size(128 << 20, 1 << 40),
    "cpu_percent": _number(0, 100, lo_open=True),
    "rescan_s": _number(1, 3600),
    "max_targets": _number(1, 4000, integer=True),
}
_RETENTION: dict[str, Callable[[Any], Any]] = {
    "max_bytes": _size(1 << 20, 1 << 50),
    "max_age_days": _number(0, 3650, lo_open=True),
    "compact_after_s": _number(1, 7 * 86400),
    "min_free_bytes": _size(0, 1 << 40),
}
_METRICS: dict[str, Callable[[Any], Any]] = {"enabled": _bool, "listen": _listen}
_ANALYSIS: dict[str, Callable[[Any], Any]] = {
    "every_s": _number(1, 86400),
    "window_s": _number(60, 7 * 86400),
    "pre_oom": _bool,
    "pre_oom_fraction": _number(0, 1, lo_open=True, hi_open=True),
    "pre_oom_sample_bytes": _size(1, 1 << 30),
    "pre_oom_window_s": _number(1, 3600),
}
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_URI_HELP = "s3://BUCKET[/PREFIX] (an S3 bucket name: 3-63 of a-z 0-9 . -) or file:///ABSOLUTE/PATH"


def _upload_uri(v: Any) -> str:
    if not isinstance(v, str) or any(c.isspace() or not c.isprintable() for c in v) or "?" in v or "#" in v:
        raise _Bad(_URI_HELP)
    scheme, sep, rest = v.partition("://")
    if scheme == "s3" and sep:
        bucket, _, prefix = rest.partition("/")
        parts = [p for p in prefix.split("/") if p]
        if not _BUCKET.fullmatch(bucket) or any(p in (".", "..") for p in parts):
            raise _Bad(_URI_HELP)
        return "s3://" + "/".join([bucket, *parts])
    if scheme == "file" and sep and rest.startswith("/") and "\0" not in rest:
        return "file://" + posixpath.normpath(rest)
    raise _Bad(_URI_HELP)


def _endpoint(v: Any) -> str:
    expected = "http://HOST[:PORT] or https://HOST[:PORT] of an S3-compatible store, e.g. http://127.0.0.1:9000"
    if not isinstance(v, str):
        raise _Bad(expected)
    m = re.fullmatch(r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])(?::(\d{1,5}))?/?", v)
    if not m or (m[3] and not 1 <= int(m[3]) <= 65535):
        raise _Bad(expected)
    return v.rstrip("/")


def _region(v: Any) -> str:
    if not isinstance(v, str) or not re.fullmatch(r"[a-z0-9-]{2,32}", v):
        raise _Bad("an AWS region name such as eu-west-1 (lower case letters, digits and dashes)")
    return v


_UPLOAD: dict[str, Callable[[Any], Any]] = {
    "uri": _upload_uri,
    "endpoint": _endpoint,
    "region": _region,
    "interval_s": _number(1, 86400),
    "timeout_s": _number(5, 3600),
    "retries": _number(1, 10, integer=True),
    "backoff_max_s": _number(1, 86400),
    "max_backlog_bytes": _size(1 << 20, 1 << 50),
}
_TARGET: dict[str, Callable[[Any], Any]] = {
    "name": _comm, "regex": _regex, "cgroup": _cgroup, "unit": _unit, "user": _user, "all": _bool,
    "tier": _choice(TIERS), "exclude": _regex, "children": _bool,
}
_SECTIONS = ("daemon", "targets", "retention", "metrics", "analysis", "upload")


class _Checker:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value: Any, expected: str) -> UsageError:
        return UsageError(f"{self.source}: {key} = {_show(value)}: expected {expected}")

    def unknown(self, key: str, prefix: str, known: tuple[str, ...] | list[str]) -> UsageError:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where = f"{prefix}{key}" if prefix else key
        return UsageError(f"{self.source}: {where}: unknown key{hint}; expected one of {', '.join(known)}")

    def table(self, data: Any, key: str, spec: Mapping[str, Callable[[Any], Any]],
              header: str | None = None) -> dict[str, Any]:
        """The checked values of table `key` (only those present: the dataclasses hold the defaults)."""
        if not isinstance(data, dict):
            raise self.fail(key, data, f"a table ({header or f'[{key}]'})")
        for k in data:          # unknown keys first: a typo would otherwise leave a default in place
            if k not in spec:
                raise self.unknown(k, key + ".", list(spec))
        out = {}
        for k, v in data.items():
            try:
                out[k] = spec[k](v)
            except _Bad as e:
                raise self.fail(f"{key}.{k}", v, str(e)) from None
        return out

    def target(self, data: Any, key: str) -> Target:
        values = self.table(data, key, _TARGET, "[[targets]]")
        if "user" in values:
            values["user"], values["uid"] = values["user"]
        chosen = [k for k in SELECTORS if k in values and k != "all"]
        if values.get("all"):
            if chosen:
                raise self.fail(f"{key}.all", True, f"no other selector beside it (got {', '.join(chosen)}): "
                                "all selects every process; leave some out with exclude")
        elif not chosen:
            raise UsageError(f"{self.source}: {key}: no selector: expected at least one of name, regex, "
                             "cgroup, unit, user (combined with AND), or all = true")
        return Target(**values)


def parse(data: Mapping[str, Any], source: str = "config.toml") -> Config:
    """A Config from the parsed TOML document (a dict); UsageError naming `source` if it is wrong."""
    c = _Checker(source)
    for k in data:
        if k not in _SECTIONS:
            raise c.unknown(k, "", _SECTIONS)
    daemon = DaemonConfig(**c.table(data.get("daemon", {}), "daemon", _DAEMON))
    retention = RetentionConfig(**c.table(data.get("retention", {}), "retention", _RETENTION))
    metrics = MetricsConfig(**c.table(data.get("metrics", {}), "metrics", _METRICS))
    analysis_values = c.table(data.get("analysis", {}), "analysis", _ANALYSIS)
    raw_targets = data.get("targets")
    if raw_targets is None or raw_targets == []:
        raise UsageError(f"{source}: targets: none given: expected at least one [[targets]] table, "
                         "e.g. [[targets]] with cgroup = \"system.slice/NAME.service\"")
    if not isinstance(raw_targets, list):
        raise c.fail("targets", raw_targets, "an array of tables ([[targets]]), at least one")
    targets = tuple(c.target(t, f"targets[{i}]") for i, t in enumerate(raw_targets))

    # Raising detail means sampling more often, so the pre-OOM mean can only be smaller. Unset, it
    # follows a smaller daemon.sample_bytes rather than fail on a key the file does not contain.
    pre = analysis_values.get("pre_oom_sample_bytes")
    if pre is None:
        analysis_values["pre_oom_sample_bytes"] = min(AnalysisConfig.pre_oom_sample_bytes, daemon.sample_bytes)
    elif pre > daemon.sample_bytes:
        raise c.fail("analysis.pre_oom_sample_bytes", data["analysis"]["pre_oom_sample_bytes"],
                     f"at most daemon.sample_bytes ({format_size(daemon.sample_bytes)}): "
                     "the pre-OOM window samples more often, with a smaller mean")
    return Config(targets, daemon, retention, metrics, AnalysisConfig(**analysis_values),
                  _upload(c, data, daemon, retention), source)


def _upload(c: _Checker, data: Mapping[str, Any], daemon: DaemonConfig,
            retention: RetentionConfig) -> UploadConfig | None:
    if "upload" not in data:
        return None
    values = c.table(data["upload"], "upload", _UPLOAD)
    if "uri" not in values:
        raise UsageError(f"{c.source}: upload.uri: missing: expected {_URI_HELP} "
                         "(leave [upload] out to upload nothing)")
    uri = values["uri"]
    if uri.startswith("file://"):
        dest, data_dir = uri[len("file://"):], daemon.data_dir
        if posixpath.commonpath([dest, data_dir]) in (dest, data_dir):       # one inside the other
            raise c.fail("upload.uri", data["upload"]["uri"],
                         f"a directory outside daemon.data_dir ({data_dir}) and not containing it")
    if values.get("endpoint") and not uri.startswith("s3://"):
        raise c.fail("upload.endpoint", data["upload"]["endpoint"], "no endpoint: it is for s3:// URIs only")
    cap = values.get("max_backlog_bytes")
    if cap is None:
        values["max_backlog_bytes"] = retention.max_bytes // 2
    elif cap > retention.max_bytes:
        raise c.fail("upload.max_backlog_bytes", data["upload"]["max_backlog_bytes"],
                     f"at most retention.max_bytes ({format_size(retention.max_bytes)}): the backlog is kept "
                     "within the dataset's disk budget")
    return UploadConfig(**values)


def load(path: str | os.PathLike[str] = DEFAULT_PATH) -> Config:
    """Read and check the configuration file; UsageError (one line) on any problem."""
    source = os.fspath(path)
    if tomllib is None:
        raise EnvironmentProblem("reading the configuration needs Python 3.11+ (tomllib) or the tomli package: "
                                 "pip install tomli")
    try:
        with open(source, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise UsageError(f"{source}: cannot read the configuration: {e.strerror or e} "
                         "(config.example.toml is a complete example: /usr/share/doc/allocsampler/ with the "
                         "Debian package, packaging/ in a checkout)") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"{source}: not UTF-8 text (byte {e.start}): TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{source}: {_toml_error(str(e))}") from None
    return parse(data, source)


def _toml_error(msg: str) -> str:
    """tomllib's "Invalid value (at line 3, column 12)" as "line 3, column 12: invalid TOML: Invalid value"."""
    m = re.fullmatch(r"(.*) \(at line (\d+), column (\d+)\)", msg, re.DOTALL)
    if m:
        return f"line {m[2]}, column {m[3]}: invalid TOML: {m[1]}"
    m = re.fullmatch(r"(.*) \(at end of document\)", msg, re.DOTALL)
    if m:
        return f"at the end of the file: invalid TOML: {m[1]}"
    return f"invalid TOML: {msg}"
