#!/usr/bin/env bash
# Build allocsampler_VERSION_amd64.deb from the wheel, for hosts that install it with apt:
#   scripts/build-deb.sh [--wheel FILE] [--revision N] [--out DIR] [--compress zstd|xz|gzip] [--python PY]
# Without --wheel it builds one (python -m build). PY runs pip (and build): an environment of the
# system's python3 with pip, by default the checkout's .venv (scripts/setup.sh).
# VERSION is the wheel's version and the Debian revision (default 1): rebuild with a higher
# revision to ship an upgrade of the same code.
#
# What the package holds (each file owned by dpkg, nothing written at install time):
#   /opt/allocsampler                    a virtual environment of the system's python3 that also sees
#                                        its packages (python3-bpfcc): the wheel and its dependencies,
#                                        compiled to bytecode here (unchecked hashes: never rewritten)
#   /usr/bin/allocsampler                the command
#   /lib/systemd/system/allocsampler.service   the unit, neither enabled nor started
#   /etc/allocsampler/config.toml        a conffile (kept on upgrade, removed on purge)
#   /usr/lib/allocsampler/               the preload shim under a stable path, the kernel headers fallback
#   /usr/share/doc/allocsampler/         README, the service's guide, every configuration key
set -euo pipefail
# The package's files are root's and 0644/0755 whatever the builder's umask (Ubuntu's 0002 would make
# them group-writable, and the in-process code's trust check then refuses the prebuilt sampler).
umask 022

here=$(cd "$(dirname "$0")/.." && pwd)
die() { printf 'build-deb: error: %s\n' "$*" >&2; exit 3; }
log() { printf 'build-deb: %s\n' "$*" >&2; }

wheel="" revision=1 out=$here/dist compress=zstd tool_py=$here/.venv/bin/python
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) wheel=${2:?}; shift 2 ;;
        --revision) revision=${2:?}; shift 2 ;;
        --out) out=${2:?}; shift 2 ;;
        --compress) compress=${2:?}; shift 2 ;;
        --python) tool_py=${2:?}; shift 2 ;;
        *) die "unknown argument $1: see the usage at the top of $0" ;;
    esac
done
[[ $revision =~ ^[0-9][0-9a-z.+~]*$ ]] || die "--revision $revision: expected a Debian revision such as 1 or 2"
case $compress in xz|zstd|gzip) ;; *) die "--compress $compress: expected zstd, xz or gzip" ;; esac
command -v dpkg-deb >/dev/null || die "dpkg-deb is missing: build on Debian or Ubuntu"

# The interpreter the package runs on, and one of its environments to run pip and build with.
sys_py=/usr/bin/python3
[ -x $sys_py ] || die "$sys_py is missing: apt-get install python3"
pyver=$($sys_py -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ -x "$tool_py" ] || die "$tool_py is missing: run scripts/setup.sh first, or name one with --python"
[ "$("$tool_py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$pyver" ] \
    || die "$tool_py is not a Python $pyver environment: recreate it with scripts/setup.sh"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -z "$wheel" ]; then
    log "building the wheel"
    "$tool_py" -m build --wheel --no-isolation --outdir "$work/dist" "$here" >&2 || die "building the wheel failed"
    wheel=$(ls "$work"/dist/allocsampler-*.whl)
fi
[ -f "$wheel" ] || die "--wheel $wheel: no such file"
version=$(basename "$wheel" | cut -d- -f2)
case $(basename "$wheel") in *-linux_x86_64.whl) ;; *) die "$wheel is not a linux_x86_64 wheel" ;; esac

stage=$work/root
opt=$stage/opt/allocsampler
site=$opt/lib/python$pyver/site-packages
log "installing $(basename "$wheel") and its dependencies into /opt/allocsampler"
# The environment: what `python3 -m venv --system-site-packages /opt/allocsampler` makes, without
# the activation scripts (they would name the staging directory).
mkdir -p "$opt/bin" "$site"
ln -s /usr/bin/python3 "$opt/bin/python3"
ln -s python3 "$opt/bin/python"
ln -s lib "$opt/lib64"
printf 'home = /usr/bin\ninclude-system-site-packages = true\nversion = %s\n' \
    "$($sys_py -c 'import platform; print(platform.python_version())')" > "$opt/pyvenv.cfg"
"$tool_py" -m pip install -q --disable-pip-version-check --no-compile --target "$site" "$wheel" >&2 \
    || die "pip install of $wheel failed"
# pip's console scripts (they would name this build's interpreter) and its note of where the wheel was
rm -rf "$site/bin" "$site"/allocsampler-*.dist-info/direct_url.json
"$tool_py" -m compileall -q -j 0 --invalidation-mode unchecked-hash -s "$stage" -p / "$site" >/dev/null \
    || die "compiling the environment to bytecode failed"
cat > "$opt/bin/allocsampler" <<EOS
#!/opt/allocsampler/bin/python3 -s
import sys

sys.dont_write_bytecode = True      # the package's files are dpkg's
from sampler.cli import entry

if __name__ == "__main__":          # multiprocessing's workers (analyze --jobs) import this file again
    sys.exit(entry())
EOS
chmod 755 "$opt/bin/allocsampler"
mkdir -p "$stage/usr/bin"
ln -s /opt/allocsampler/bin/allocsampler "$stage/usr/bin/allocsampler"

log "unit, configuration, documentation"
install -D -m 0644 "$here/packaging/allocsampler.service" "$stage/lib/systemd/system/allocsampler.service"
install -D -m 0640 "$here/packaging/config.toml" "$stage/etc/allocsampler/config.toml"
chmod 0750 "$stage/etc/allocsampler"
install -D -m 0755 "$here/scripts/kernel-headers.sh" "$stage/usr/lib/allocsampler/kernel-headers.sh"
ln -s "/opt/allocsampler/lib/python$pyver/site-packages/sampler/inprocess/prebuilt/liballocsampler_preload.so" \
    "$stage/usr/lib/allocsampler/liballocsampler_preload.so"
doc=$stage/usr/share/doc/allocsampler
install -D -m 0644 "$here/README.md" "$doc/README.md"
install -m 0644 "$here/packaging/README.md" "$doc/README.service.md"
install -m 0644 "$here/packaging/config.example.toml" "$doc/config.example.toml"
cat > "$doc/copyright" <<EOS
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: allocsampler

Files: *
License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.
 /opt/allocsampler/lib also holds the Python packages allocsampler depends on, each under its
 own license (their *.dist-info directories).
EOS

mkdir -p "$stage/DEBIAN"
install -m 0755 "$here/packaging/deb/postinst" "$here/packaging/deb/prerm" "$here/packaging/deb/postrm" "$stage/DEBIAN/"
echo /etc/allocsampler/config.toml > "$stage/DEBIAN/conffiles"
# for `dpkg --verify allocsampler` (conffiles are tracked by dpkg itself)
(cd "$stage" && find . -type f ! -path ./DEBIAN/\* ! -path ./etc/\* -printf '%P\0' | LC_ALL=C sort -z \
    | xargs -0 md5sum) > "$stage/DEBIAN/md5sums"
size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
next=$(echo "$pyver" | awk -F. '{print $1 "." $2 + 1}')
cat > "$stage/DEBIAN/control" <<EOS
Package: allocsampler
Version: $version-$revision
Architecture: amd64
Maintainer: allocsampler developers <allocsampler@localhost>
Installed-Size: $size
Depends: python3 (>= $pyver), python3 (<< $next), python3-bpfcc, libc6
Suggests: linux-headers-amd64, libc6-dbg, bpfcc-tools
Section: admin
Priority: optional
Description: continuous, low-overhead memory allocation sampler (eBPF)
 Attaches to running processes (no restart, no code change), samples
 allocation stacks by bytes at a cost that can stay on, and writes Parquet:
 which call stacks hold how much memory over time, with standard errors,
 and findings (leaks, arena bloat, GPU memory) from allocsampler analyze.
 .
 Recording compiles BPF against the running kernel's headers: install
 linux-headers-\$(uname -r), or run /usr/lib/allocsampler/kernel-headers.sh
 where the kernel has no headers package. The service (allocsampler.service)
 is installed neither enabled nor started.
EOS

mkdir -p "$out"
deb=$out/allocsampler_${version}-${revision}_amd64.deb
level=$([ "$compress" = gzip ] && echo 1 || echo 6)
dpkg-deb --root-owner-group -Z"$compress" -z"$level" --build "$stage" "$deb" >/dev/null || die "dpkg-deb --build failed"
log "built $deb ($(du -h "$deb" | cut -f1), $((size / 1024)) MiB installed)"
echo "$deb"
