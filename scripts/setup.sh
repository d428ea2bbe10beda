#!/usr/bin/env bash
# Idempotent set-up for allocsampler on Debian 12, as root.
#   scripts/setup.sh          system packages, kernel headers, tracefs, .venv with the project
#   scripts/setup.sh --no-venv  system part only
# Ubuntu 22.04+: same apt packages (python3-bpfcc bpfcc-tools linux-headers-$(uname -r)).
# Fedora: dnf install bcc bcc-tools python3-bcc kernel-devel-$(uname -r) gcc.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
want_venv=1
[ "${1:-}" = "--no-venv" ] && want_venv=0

log() { printf 'setup: %s\n' "$*" >&2; }
# how long each step took, said as it ends
step_t=$SECONDS
took() { log "$1: $((SECONDS - step_t)) s"; step_t=$SECONDS; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 3; }

[ "$(id -u)" = 0 ] || die "must run as root (BPF and package installs need it): sudo $0"

apt_updated=0
apt_install() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ $apt_updated = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed: check the network or apt sources"
        apt_updated=1
    fi
    log "installing ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2 \
        || die "apt-get install ${missing[*]} failed"
}

# bcc (Python bindings + tools, memleak-bpfcc is our benchmark peer), a compiler for test workloads.
apt_install python3-bpfcc bpfcc-tools python3-venv gcc libc6-dev binutils
# <sys/sdt.h>: the preload shim's USDT probes (sampler/inprocess/preload.c); g++ for its C++ test.
apt_install systemtap-sdt-dev g++
# jemalloc: the C server of tests/analysis/test_diagnoses.py runs on it (extents and their allocations)
apt_install libjemalloc2
# Python headers: the readable-stacks tests build a C extension (tests/workloads/leakext.c).
apt_install python3-dev
# Debug symbols for libc: readable malloc-internal frames (symbolizer uses /usr/lib/debug/.build-id).
apt_install libc6-dbg
# Other allocators the tests record (jemalloc, tcmalloc), as users preload them.
apt_install libjemalloc2 libtcmalloc-minimal4
# Headless browser and a font for the HTML report's rendering test (tests/analysis/test_report_html.py).
apt_install chromium fonts-dejavu-core
# Real servers that the family tests and scripts/bench_servers.py start and record (as nobody, on
# sockets in temporary directories): PostgreSQL with pgbench and psql, Redis with redis-benchmark.
apt_install postgresql postgresql-client redis-server redis-tools
# A Java runtime for pyspark in local mode: docs/querying.md's Spark fleet recipes (tests/dataset/test_querying.py).
apt_install default-jre-headless

took "system packages"

# Kernel headers: bcc compiles BPF C against /lib/modules/$(uname -r)/build (the running kernel's
# package, or the nearest ones unpacked without the kernel image their package would pull in).
bash "$here/scripts/kernel-headers.sh" || exit $?
took "kernel headers"

# tracefs (uprobe and tracepoint attachment goes through it).
if [ ! -e /sys/kernel/tracing/uprobe_events ] && [ ! -e /sys/kernel/debug/tracing/uprobe_events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null || mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null \
        || die "tracefs is not mounted and could not be mounted: mount -t tracefs tracefs /sys/kernel/tracing"
    log "mounted tracefs"
fi

[ $want_venv = 1 ] || exit 0

# The venv must come from the interpreter whose dist-packages hold bcc.
sys_py=/usr/bin/python3
$sys_py -c 'import bcc' 2>/dev/null || die "bcc is not importable from $sys_py: apt-get install python3-bpfcc"
venv="$here/.venv"
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import bcc' 2>/dev/null; then
    rm -rf "$venv"
    log "creating $venv"
    $sys_py -m venv --system-site-packages "$venv"
fi
stamp="$venv/.installed-$(sha1sum "$here/pyproject.toml" | cut -c1-12)"
if [ ! -e "$stamp" ] || ! "$venv/bin/python" -c 'import sampler' 2>/dev/null; then
    log "installing allocsampler and test extras into $venv"
    "$venv/bin/pip" install -q --disable-pip-version-check -e "$here[test]" >&2 || die "pip install failed"
    rm -f "$venv"/.installed-*
    touch "$stamp"
fi
took "Python environment"
# In-process code (build/): the LD_PRELOAD shim, the injected sampler and its placement helper;
# rebuilt only when their sources changed.
"$venv/bin/python" -m sampler.inprocess >/dev/null || die "building the in-process samplers failed: see the message above"
# Bytecode written now, as an installed package has it: a recorder starting under
# PYTHONDONTWRITEBYTECODE would otherwise compile its ~200 modules at every start (~0.15 s of CPU).
"$venv/bin/python" -m compileall -q "$here/sampler" >/dev/null || die "compiling sampler/ to bytecode failed"
took "in-process code and bytecode"
log "ready: $venv/bin/allocsampler"
