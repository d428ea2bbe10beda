"""The daemon's configuration (sampler/service/config.py): the shipped example, defaults, one-line errors
naming the key and what is allowed, and target selection."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
from conftest import ROOT

from sampler.errors import UsageError
from sampler.proc.process import ProcView
from sampler.service import config
from sampler.service.config import ALWAYS_ON, ATTACH, PRELOAD_AWARE, Config, Target

EXAMPLE = ROOT / "packaging" / "config.example.toml"
ONE_TARGET = '[[targets]]\nname = "postgres"\n'


def load_text(tmp_path: Path, text: str) -> Config:
    p = tmp_path / "config.toml"
    p.write_text(text)
    return config.load(p)


def error_of(tmp_path: Path, text: str) -> str:
    with pytest.raises(UsageError) as e:
        load_text(tmp_path, text)
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{tmp_path / 'config.toml'}: "), msg
    return msg


def proc(comm: str = "python3", cmdline: str = "/usr/bin/python3 serve.py", uid: int = 1000,
         cgroup: str = "/system.slice/a.service", pid: int = 42, systemd_path: str | None = None) -> ProcView:
    return ProcView(pid, comm, cmdline, uid, cgroup, cgroup if systemd_path is None else systemd_path)


# --- the example and the defaults -----------------------------------------------------------------

def test_example_loads_with_its_documented_defaults():
    c = config.load(EXAMPLE)
    assert c.daemon == config.DaemonConfig()
    assert c.retention == config.RetentionConfig()
    assert c.metrics == config.MetricsConfig()
    assert c.analysis == config.AnalysisConfig()
    service, server, python = c.targets
    assert (service.cgroup, service.tier) == ("system.slice/inference.service", ATTACH)
    assert (server.unit, server.tier, server.children) == ("postgresql@15-main.service", ATTACH, True)
    assert python.tier == ALWAYS_ON
    assert c.source == str(EXAMPLE)


def test_the_packages_config_selects_nothing_until_the_admin_does(tmp_path):
    """The Debian package's conffile (packaging/config.toml): the service refuses to start on it,
    saying what to add; its commented examples, uncommented, are valid targets."""
    shipped = ROOT / "packaging" / "config.toml"
    with pytest.raises(UsageError, match=r"targets: none given: expected at least one \[\[targets\]\]"):
        config.load(shipped)
    text = shipped.read_text()
    examples = "\n".join(ln.removeprefix("# ") for ln in text.splitlines()
                         if ln.startswith(("# [[targets]]", "# cgroup", "# regex", "# tier")))
    c = load_text(tmp_path, examples + "\n" + text)
    assert [(t.cgroup, t.tier) for t in c.targets] == [("system.slice/inference.service", ATTACH), (None, ALWAYS_ON)]
    assert c.targets[1].regex and c.daemon == config.DaemonConfig()


def test_example_documents_every_key():
    text = EXAMPLE.read_text()
    for section in (config.DaemonConfig, config.RetentionConfig, config.MetricsConfig, config.AnalysisConfig):
        for f in fields(section):
            assert f"\n{f.name} = " in text, f.name
    for key in ("name", "regex", "cgroup", "user", "all", "tier", "exclude"):
        assert f"{key} (" in text or f"{key} = " in text, key
    assert "\n# [upload]\n" in text                 # off by default: documented commented out
    for f in fields(config.UploadConfig):
        assert f"\n# {f.name} = " in text, f.name


def test_upload_is_off_by_default_and_read(tmp_path):
    assert config.load(EXAMPLE).upload is None
    c = load_text(tmp_path, f'[retention]\nmax_bytes = "2G"\n[upload]\nuri = "s3://my-bucket//fleet/"\n'
                            f'endpoint = "http://127.0.0.1:9000/"\nregion = "eu-west-1"\ninterval_s = 5\n{ONE_TARGET}')
    u = c.upload
    assert (u.uri, u.endpoint, u.region, u.interval_s, u.timeout_s, u.retries, u.max_backlog_bytes) == (
        "s3://my-bucket/fleet", "http://127.0.0.1:9000", "eu-west-1", 5, 300, 3, 1 << 30)   # half of max_bytes
    d = c.to_dict()
    assert d["upload"]["max_backlog_bytes"] == "1G" and config.parse(d) == c
    assert load_text(tmp_path, f'[upload]\nuri = "file:///mnt/nfs/alloc"\n{ONE_TARGET}').upload.uri == \
        "file:///mnt/nfs/alloc"


def test_example_python_target_selects_python_but_not_pip():
    python = config.load(EXAMPLE).targets[2]
    for cmd in ("/usr/bin/python3.11 -m http.server", "python train.py", "python3", ".venv/bin/python x.py",
                "python pipeline.py"):
        assert python.matches(proc(cmdline=cmd, cgroup="/user.slice")), cmd
    for cmd in ("vim python.txt", "/usr/bin/pythonista", "/usr/bin/python3 /usr/bin/pip install x",
                "python -m pip install torch", "/usr/bin/pip3 list"):
        assert not python.matches(proc(cmdline=cmd, cgroup="/user.slice")), cmd


def test_defaults_of_a_minimal_file(tmp_path):
    c = load_text(tmp_path, "[[targets]]\nall = true\n")
    d = c.daemon
    assert (d.data_dir, d.interval_s, d.sample_bytes, d.cpu_budget_percent, d.fault_period, d.max_rss,
            d.cpu_percent, d.rescan_s) == ("/var/lib/allocsampler", 10, 512 << 10, 3, 61, 256 << 20, 10, 5)
    r = c.retention
    assert (r.max_bytes, r.max_age_days, r.compact_after_s) == (10 << 30, 14, 3600)
    assert (c.metrics.enabled, c.metrics.listen, c.metrics.host, c.metrics.port) == (
        True, "127.0.0.1:9464", "127.0.0.1", 9464)
    assert c.metrics.loopback_only
    a = c.analysis
    assert (a.every_s, a.pre_oom, a.pre_oom_fraction, a.pre_oom_sample_bytes, a.pre_oom_window_s) == (
        300, True, 0.9, 64 << 10, 60)
    assert c.targets == (Target(all=True),)
    assert c.targets[0].tier == ATTACH


def test_values_are_read(tmp_path):
    c = load_text(tmp_path, """
[daemon]
data_dir = "/srv/alloc/"
interval_s = 2.5
sample_bytes = "1.5M"
max_rss = 536870912
[metrics]
listen = "[::1]:9000"
enabled = false
[[targets]]
user = "root"
regex = "gunicorn"
tier = "preload-aware"
[[targets]]
user = "4242"
""")
    assert (c.daemon.data_dir, c.daemon.interval_s, c.daemon.sample_bytes, c.daemon.max_rss) == (
        "/srv/alloc", 2.5, 3 << 19, 512 << 20)
    assert (c.metrics.host, c.metrics.port, c.metrics.loopback_only, c.metrics.enabled) == ("::1", 9000, True, False)
    assert (c.targets[0].user, c.targets[0].uid, c.targets[0].tier) == ("root", 0, PRELOAD_AWARE)
    assert (c.targets[1].user, c.targets[1].uid) == ("4242", 4242)


def test_non_loopback_listen_is_allowed_and_flagged(tmp_path):
    c = load_text(tmp_path, f'[metrics]\nlisten = "0.0.0.0:9464"\n{ONE_TARGET}')
    assert not c.metrics.loopback_only


def test_pre_oom_sample_bytes_follows_a_smaller_sample_bytes_when_unset(tmp_path):
    c = load_text(tmp_path, f'[daemon]\nsample_bytes = "16K"\n{ONE_TARGET}')
    assert c.analysis.pre_oom_sample_bytes == 16 << 10


def test_to_dict_round_trips_and_is_json():
    c = config.load(EXAMPLE)
    d = c.to_dict()
    json.dumps(d)
    assert d["daemon"]["sample_bytes"] == "512K" and d["retention"]["max_bytes"] == "10G"
    assert config.parse(d) == c
    assert list(d) == ["daemon", "targets", "retention", "metrics", "analysis"]


@pytest.mark.parametrize("text,n", [("512K", 512 << 10), ("1M", 1 << 20), ("1.5G", 3 << 29), ("64MiB", 64 << 20),
                                    ("10 g", 10 << 30), ("4096", 4096), ("2kb", 2048), ("1T", 1 << 40)])
def test_parse_size(text, n):
    assert config.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "K", "12Q", "-1K", "1e3", "1,5M", "0x10", "9" * 400 + "K"])
def test_parse_size_rejects(text):
    assert config.parse_size(text) is None


@pytest.mark.parametrize("n,text", [(512 << 10, "512K"), (10 << 30, "10G"), (1000, "1000"), (3 << 19, "1536K")])
def test_format_size_is_exact(n, text):
    assert config.format_size(n) == text and config.parse_size(text) == n


# --- errors: one line naming the key, the value and what is allowed ------------------------------

BAD = [
    # (id, file, key, fragments of the message)
    ("interval-string", f'[daemon]\ninterval_s = "10"\n{ONE_TARGET}', "daemon.interval_s",
     ['= "10"', "a number from 1 to 3600"]),
    ("interval-zero", f"[daemon]\ninterval_s = 0\n{ONE_TARGET}", "daemon.interval_s", ["= 0:", "from 1 to 3600"]),
    ("interval-bool", f"[daemon]\ninterval_s = true\n{ONE_TARGET}", "daemon.interval_s", ["= true:", "a number"]),
    ("interval-nan", f"[daemon]\ninterval_s = nan\n{ONE_TARGET}", "daemon.interval_s", ["= nan:", "a number"]),
    ("interval-huge", f"[daemon]\ninterval_s = {10**30}\n{ONE_TARGET}", "daemon.interval_s", ["from 1 to 3600"]),
    ("interval-table", f"[daemon]\ninterval_s = {{ a = 1 }}\n{ONE_TARGET}", "daemon.interval_s",
     ["= { a = 1 }:", "a number"]),
    ("fault-period-float", f"[daemon]\nfault_period = 1.5\n{ONE_TARGET}", "daemon.fault_period",
     ["= 1.5:", "an integer from 1 to 1048576"]),
    ("cpu-budget-high", f"[daemon]\ncpu_budget_percent = 101\n{ONE_TARGET}", "daemon.cpu_budget_percent",
     ["= 101:", "from 0 to 100"]),
    ("cpu-percent-zero", f"[daemon]\ncpu_percent = 0\n{ONE_TARGET}", "daemon.cpu_percent",
     ["= 0:", "a number > 0 and <= 100"]),
    ("rescan-negative", f"[daemon]\nrescan_s = -5\n{ONE_TARGET}", "daemon.rescan_s", ["= -5:", "from 1 to 3600"]),
    ("size-unit", f'[daemon]\nsample_bytes = "12Q"\n{ONE_TARGET}', "daemon.sample_bytes",
     ['= "12Q"', "a size from 1 to 1G", "512K"]),
    ("size-too-big", f'[daemon]\nsample_bytes = "2G"\n{ONE_TARGET}', "daemon.sample_bytes", ['"2G"', "to 1G"]),
    ("size-negative", f"[daemon]\nsample_bytes = -1\n{ONE_TARGET}", "daemon.sample_bytes", ["= -1:", "a size"]),
    ("size-bool", f"[daemon]\nsample_bytes = false\n{ONE_TARGET}", "daemon.sample_bytes", ["= false:", "a size"]),
    ("max-rss-small", f'[daemon]\nmax_rss = "64M"\n{ONE_TARGET}', "daemon.max_rss", ['"64M"', "from 128M to 1T"]),
    ("data-dir-relative", f'[daemon]\ndata_dir = "var/lib"\n{ONE_TARGET}', "daemon.data_dir",
     ['"var/lib"', "an absolute path"]),
    ("daemon-not-table", f"daemon = 5\n{ONE_TARGET}", "daemon", ["= 5:", "a table ([daemon])"]),
    ("tier", '[[targets]]\nname = "a"\n[[targets]]\nname = "b"\n[[targets]]\nname = "c"\ntier = "fast"\n',
     "targets[2].tier", ['= "fast"', "expected one of always-on, attach, preload-aware"]),
    ("tier-type", '[[targets]]\nname = "a"\ntier = 1\n', "targets[0].tier", ["= 1:", "one of always-on"]),
    ("regex", '[[targets]]\nregex = "(python"\n', "targets[0].regex",
     ['= "(python"', "a valid regular expression", "missing )"]),
    ("exclude-regex", '[[targets]]\nall = true\nexclude = "["\n', "targets[0].exclude",
     ['= "["', "a valid regular expression"]),
    ("unknown-user", '[[targets]]\nuser = "no-such-user-allocsampler"\n', "targets[0].user",
     ['"no-such-user-allocsampler"', "a user name known to this host", "numeric uid"]),
    ("negative-uid", "[[targets]]\nuser = -1\n", "targets[0].user", ["= -1:", "a uid from 0 to 4294967294"]),
    ("long-name", '[[targets]]\nname = "a_very_long_process_name"\n', "targets[0].name",
     ['"a_very_long_process_name"', "at most 15 bytes", "regex"]),
    ("empty-name", '[[targets]]\nname = ""\n', "targets[0].name", ['= "":', "a process name"]),
    ("cgroup-dotdot", '[[targets]]\ncgroup = "system.slice/../x"\n', "targets[0].cgroup",
     ['"system.slice/../x"', "a cgroup v2 path"]),
    ("cgroup-root", '[[targets]]\ncgroup = "/"\n', "targets[0].cgroup", ['= "/"', "all = true"]),
    ("all-with-name", '[[targets]]\nall = true\nname = "x"\nuser = 0\n', "targets[0].all",
     ["= true:", "no other selector", "name, user", "exclude"]),
    ("all-string", '[[targets]]\nall = "yes"\n', "targets[0].all", ['= "yes"', "true or false"]),
    ("no-selector", '[[targets]]\ntier = "attach"\n', "targets[0]",
     ["no selector", "name, regex, cgroup, unit, user", "all = true"]),
    ("no-selector-all-false", "[[targets]]\nall = false\n", "targets[0]", ["no selector"]),
    ("target-unknown-key", '[[targets]]\nnmae = "x"\n', "targets[0].nmae", ["unknown key (did you mean name?)"]),
    ("target-not-table", 'targets = ["x"]\n', "targets[0]", ['= "x"', "a table ([[targets]])"]),
    ("zero-targets", '[daemon]\ninterval_s = 5\n', "targets", ["none given", "at least one [[targets]]"]),
    ("empty-targets", "targets = []\n", "targets", ["at least one [[targets]]"]),
    ("targets-table", '[targets]\nname = "x"\n', "targets", ['= { name = "x" }', "an array of tables"]),
    ("unknown-key", f"[daemon]\nintervl_s = 5\n{ONE_TARGET}", "daemon.intervl_s",
     ["unknown key (did you mean interval_s?)", "expected one of data_dir, interval_s"]),
    ("unknown-key-far", f"[daemon]\nzzz = 5\n{ONE_TARGET}", "daemon.zzz", ["unknown key; expected one of"]),
    ("unknown-section", f"[deamon]\ninterval_s = 5\n{ONE_TARGET}", "deamon",
     ["unknown key (did you mean daemon?)", "daemon, targets, retention, metrics, analysis"]),
    ("listen-no-port", f'[metrics]\nlisten = "localhost"\n{ONE_TARGET}', "metrics.listen",
     ['"localhost"', "HOST:PORT", "a port from 1 to 65535"]),
    ("listen-port-range", f'[metrics]\nlisten = "127.0.0.1:99999"\n{ONE_TARGET}', "metrics.listen",
     ['"127.0.0.1:99999"', "1 to 65535"]),
    ("listen-port-zero", f'[metrics]\nlisten = "127.0.0.1:0"\n{ONE_TARGET}', "metrics.listen", ["1 to 65535"]),
    ("listen-ipv6-unbracketed", f'[metrics]\nlisten = "::1:9464"\n{ONE_TARGET}', "metrics.listen",
     ['"::1:9464"', "IPv6 in brackets"]),
    ("listen-hostname", f'[metrics]\nlisten = "example.com:80"\n{ONE_TARGET}', "metrics.listen",
     ['"example.com:80"', "an IP address"]),
    ("listen-bad-ip", f'[metrics]\nlisten = "127.0.0.300:9464"\n{ONE_TARGET}', "metrics.listen", ["HOST:PORT"]),
    ("listen-int", f"[metrics]\nlisten = 9464\n{ONE_TARGET}", "metrics.listen", ["= 9464:", "HOST:PORT"]),
    ("metrics-enabled", f'[metrics]\nenabled = "yes"\n{ONE_TARGET}', "metrics.enabled", ['"yes"', "true or false"]),
    ("retention-bytes", f'[retention]\nmax_bytes = "100K"\n{ONE_TARGET}', "retention.max_bytes",
     ['"100K"', "from 1M to 1P"]),
    ("retention-age", f"[retention]\nmax_age_days = 0\n{ONE_TARGET}", "retention.max_age_days",
     ["= 0:", "> 0 and <= 3650"]),
    ("compact", f"[retention]\ncompact_after_s = 0.5\n{ONE_TARGET}", "retention.compact_after_s", ["from 1 to"]),
    ("pre-oom-fraction-1", f"[analysis]\npre_oom_fraction = 1.0\n{ONE_TARGET}", "analysis.pre_oom_fraction",
     ["= 1.0:", "a number > 0 and < 1"]),
    ("pre-oom-fraction-0", f"[analysis]\npre_oom_fraction = 0\n{ONE_TARGET}", "analysis.pre_oom_fraction",
     ["> 0 and < 1"]),
    ("pre-oom-bytes", f'[analysis]\npre_oom_sample_bytes = "1M"\n{ONE_TARGET}', "analysis.pre_oom_sample_bytes",
     ['"1M"', "at most daemon.sample_bytes (512K)"]),
    ("every", f"[analysis]\nevery_s = 0\n{ONE_TARGET}", "analysis.every_s", ["from 1 to 86400"]),
    ("sample-cap", f"[daemon]\nmax_samples_per_s = 2.5\n{ONE_TARGET}", "daemon.max_samples_per_s",
     ["= 2.5:", "an integer from 0 to 1000000"]),
    ("vm-budget", f"[daemon]\nvm_events_per_s = -1\n{ONE_TARGET}", "daemon.vm_events_per_s",
     ["from 0 to 1000000"]),
    ("window", f"[analysis]\npre_oom_window_s = 7200\n{ONE_TARGET}", "analysis.pre_oom_window_s",
     ["from 1 to 3600"]),
    ("analysis-unknown", f"[analysis]\npre_oom_fractoin = 0.5\n{ONE_TARGET}", "analysis.pre_oom_fractoin",
     ["did you mean pre_oom_fraction?"]),
]


@pytest.mark.parametrize("text,key,fragments", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_the_key(tmp_path, text, key, fragments):
    msg = error_of(tmp_path, text)
    rest = msg[len(f"{tmp_path / 'config.toml'}: "):]
    assert rest.startswith(f"{key} = ") or rest.startswith(f"{key}: "), msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)


def test_message_format_matches_the_documented_one():
    data = {"targets": [{"name": "a"}, {"name": "b"}, {"name": "c", "tier": "fast"}]}
    with pytest.raises(UsageError) as e:
        config.parse(data, "config.toml")
    assert str(e.value) == 'config.toml: targets[2].tier = "fast": expected one of always-on, attach, preload-aware'
    assert e.value.exit_code == 2


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(UsageError) as e:
        config.load(tmp_path / "nope.toml")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'nope.toml'}: cannot read") and "No such file" in msg and "\n" not in msg


def test_toml_syntax_error_names_line_and_column(tmp_path):
    msg = error_of(tmp_path, f"{ONE_TARGET}[daemon]\ninterval_s = = 3\n")
    assert "line 4, column 14: invalid TOML" in msg, msg


def test_duplicate_key_is_a_syntax_error(tmp_path):
    msg = error_of(tmp_path, f"[daemon]\ninterval_s = 3\ninterval_s = 4\n{ONE_TARGET}")
    assert "line 3" in msg and "invalid TOML" in msg, msg


def test_not_utf8(tmp_path):
    p = tmp_path / "config.toml"
    p.write_bytes(b'[[targets]]\nname = "caf\xe9"\n')
    with pytest.raises(UsageError, match="not UTF-8"):
        config.load(p)


def test_unprintable_value_stays_on_one_line(tmp_path):
    msg = error_of(tmp_path, '[[targets]]\nname = "a"\ntier = """x\ny"""\n')
    assert '"x\\ny"' in msg


# --- target selection --------------------------------------------------------------------------

def target(text: str) -> Target:
    return config.parse({"targets": [json.loads(text)]}).targets[0]


def test_name_is_exact():
    t = target('{"name": "python3"}')
    assert t.matches(proc(comm="python3"))
    assert not t.matches(proc(comm="python3.11")) and not t.matches(proc(comm="python"))


def test_regex_searches_the_command_line():
    t = target('{"regex": "serve\\\\.py"}')
    assert t.matches(proc(cmdline="/usr/bin/python3 serve.py --port 1"))
    assert not t.matches(proc(cmdline="/usr/bin/python3 serve_py"))
    assert not t.matches(proc(cmdline=""))          # kernel threads and zombies have none


@pytest.mark.parametrize("configured", ["system.slice/a.service", "/system.slice/a.service",
                                        "/sys/fs/cgroup/system.slice/a.service", "system.slice/a.service/",
                                        "/sys/fs/cgroup/unified/system.slice/a.service"])
def test_cgroup_is_this_one_or_below(configured):
    t = target(json.dumps({"cgroup": configured}))
    assert t.cgroup == "system.slice/a.service"
    assert t.matches(proc(cgroup="/system.slice/a.service"))
    assert t.matches(proc(cgroup="/system.slice/a.service/worker"))
    assert not t.matches(proc(cgroup="/system.slice/a.service2"))
    assert not t.matches(proc(cgroup="/system.slice"))
    assert not t.matches(proc(cgroup="/"))
    assert not t.matches(proc(cgroup=""))           # no cgroup v2 membership known


def test_unit_selects_a_real_process_in_its_systemd_cgroup(tmp_path):
    """A process moved into a unit's cgroup in systemd's hierarchy (name=systemd on cgroup v1
    hosts, the unified one on v2) is selected by `unit`, its own cgroup below the unit's too; a
    unit whose name only starts the same is not. One line for a value that is not a unit name."""
    roots = [m.split()[1] for m in Path("/proc/mounts").read_text().splitlines()
             if " cgroup " in m and "name=systemd" in m] or \
            [m.split()[1] for m in Path("/proc/mounts").read_text().splitlines() if " cgroup2 " in m]
    assert roots, "no systemd or v2 cgroup hierarchy mounted"
    unit = Path(roots[0]) / "allocsampler-test.slice" / f"unit-{os.getpid()}.service"
    worker = unit / "worker"
    worker.mkdir(parents=True)
    p = subprocess.Popen(["sleep", "30"])
    try:
        (worker / "cgroup.procs").write_text(str(p.pid))
        view = ProcView.read(p.pid)
        assert view is not None and view.systemd_path.endswith(f"unit-{os.getpid()}.service/worker"), view
        assert target(json.dumps({"unit": unit.name})).matches(view)
        assert target(json.dumps({"unit": "allocsampler-test.slice"})).matches(view)
        assert not target(json.dumps({"unit": f"unit-{os.getpid()}.serv.service"})).matches(view)
        assert not target(json.dumps({"unit": unit.name})).matches(ProcView.read(os.getpid()))
    finally:
        p.kill()
        p.wait()
        for d in (worker, unit, unit.parent):
            with contextlib.suppress(OSError):
                d.rmdir()
    msg = error_of(tmp_path, '[[targets]]\nunit = "../x.service"\n')
    assert "unit" in msg and "systemd unit name" in msg, msg
    assert "unit" in error_of(tmp_path, '[[targets]]\ntier = "attach"\n')


def test_a_unit_is_the_system_managers_not_a_user_units_or_a_containers_of_the_same_name():
    """`unit = "postgresql@15-main.service"` selects the system service, under its slices, and what
    runs below it; a user's unit of that name (systemd-run --user --unit=..., which any logged-in user
    can start) or a container's service of that name is not it."""
    t = target('{"unit": "postgresql@15-main.service"}')
    sel = [("/system.slice/postgresql@15-main.service", True),
           ("/system.slice/system-postgresql.slice/postgresql@15-main.service/worker", True),
           ("/user.slice/user-65534.slice/user@65534.service/app.slice/postgresql@15-main.service", False),
           ("/system.slice/docker-0123abcd.scope/system.slice/postgresql@15-main.service", False),
           ("/machine.slice/machine-x.scope/payload/system.slice/postgresql@15-main.service", False),
           ("/system.slice/postgresql@15-main.service.d", False), ("", False)]
    for path, want in sel:
        assert t.matches(proc(systemd_path=path)) is want, path


def test_user_by_name_and_uid():
    assert target('{"user": "root"}').matches(proc(uid=0))
    assert not target('{"user": "root"}').matches(proc(uid=1000))
    assert target('{"user": 1000}').matches(proc(uid=1000))
    assert target('{"user": "1000"}').matches(proc(uid=1000))


def test_all_and_exclude():
    t = target('{"all": true, "exclude": "^sshd"}')
    assert t.matches(proc(cmdline="/usr/bin/python3 x.py"))
    assert not t.matches(proc(cmdline="sshd: root@pts/0"))


def test_selectors_combine_with_and():
    t = target('{"name": "python3", "user": 1000, "cgroup": "user.slice", "regex": "train"}')
    good = dict(comm="python3", uid=1000, cgroup="/user.slice/user-1000.slice/session-1.scope",
                cmdline="python3 train.py")
    assert t.matches(proc(**good))
    for k, v in [("comm", "python"), ("uid", 0), ("cgroup", "/system.slice/a.service"), ("cmdline", "python3 eval.py")]:
        assert not t.matches(proc(**{**good, k: v})), k


def test_first_matching_target_decides():
    c = config.parse({"targets": [{"cgroup": "system.slice/a.service", "tier": "attach"},
                                  {"regex": "python", "tier": "always-on"}]})
    assert c.target_for(proc(cgroup="/system.slice/a.service")).tier == ATTACH
    assert c.target_for(proc(cgroup="/system.slice/b.service")).tier == ALWAYS_ON
    assert c.target_for(proc(cmdline="/usr/sbin/nginx", cgroup="/system.slice/b.service")) is None


def test_describe():
    assert target('{"cgroup": "/system.slice/a.service", "exclude": "x"}').describe() == (
        "cgroup=system.slice/a.service exclude=x")
    assert target('{"all": true}').describe() == "all"


def test_procview_reads_this_process():
    me = ProcView.read(os.getpid())
    assert me is not None
    assert me.pid == os.getpid() and me.uid == os.geteuid()
    assert me.comm == Path("/proc/self/comm").read_text().strip()
    assert me.cmdline == Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()
    assert me.cgroup_path.startswith("/")
    assert target('{"all": true}').matches(me)


def test_procview_of_a_missing_process_is_none():
    assert ProcView.read(2**22 + 1) is None        # above pid_max's ceiling
