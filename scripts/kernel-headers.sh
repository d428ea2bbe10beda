#!/usr/bin/env bash
# Kernel headers for bcc, which compiles the BPF programs against /lib/modules/$(uname -r)/build.
# Idempotent, as root. scripts/setup.sh runs it; the Debian package ships it as
# /usr/lib/allocsampler/kernel-headers.sh (its postinst says when a host needs it).
# - apt has linux-headers-$(uname -r): that is installed.
# - It has none (custom or cloud kernels): the newest amd64 headers apt offers are unpacked into
#   /usr/local/lib/allocsampler/kernel-headers/<version> and linked. Installed, their package would
#   pull in its kernel image and regenerate an initramfs that recording never boots. Uprobe,
#   tracepoint and perf-event programs only need pt_regs and tracefs formats, stable across these
#   versions.
set -euo pipefail

log() { printf 'kernel-headers: %s\n' "$*" >&2; }
die() { printf 'kernel-headers: error: %s\n' "$*" >&2; exit 3; }
[ "$(id -u)" = 0 ] || die "must run as root: sudo $0"

kver=$(uname -r)
moddir=/lib/modules/$kver
[ -e "$moddir/build/include" ] && exit 0

apt_updated=0
apt_update() {
    [ $apt_updated = 1 ] && return 0
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed: check the network or apt sources"
    apt_updated=1
}

if apt-cache show "linux-headers-$kver" >/dev/null 2>&1 || { apt_update && apt-cache show "linux-headers-$kver" >/dev/null 2>&1; }; then
    log "installing linux-headers-$kver"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "linux-headers-$kver" >&2 \
        || die "apt-get install linux-headers-$kver failed"
    exit 0
fi

arch=$(dpkg --print-architecture)
pkg=$(apt-cache search --names-only "^linux-headers-[0-9]" 2>/dev/null | awk '{print $1}' \
      | grep -E -- "-$arch\$" | grep -v -E -- '-(rt|cloud)-' | sort -V | tail -n 1)
[ -n "$pkg" ] || die "no linux-headers package for $kver and none to fall back to: install kernel headers into $moddir/build"
ver=${pkg#linux-headers-}; ver=${ver%-$arch}
# Its files and its two companions' are unpacked into a directory of ours (relative links between
# them kept), outside dpkg's database.
prefix=/usr/local/lib/allocsampler/kernel-headers/$ver
build=$prefix/usr/src/linux-headers-$ver-$arch
common=$prefix/usr/src/linux-headers-$ver-common
if [ ! -d "$build/include" ] || [ ! -d "$common/include" ]; then
    apt_update
    dl=$(mktemp -d) && chmod 755 "$dl" && { chown _apt "$dl" 2>/dev/null || true; }
    (cd "$dl" && apt-get download -qq "$pkg" "linux-headers-$ver-common" "linux-kbuild-$ver" >&2) \
        || die "apt-get download of $pkg and its companions failed: check the network or apt sources"
    rm -rf "$prefix" && mkdir -p "$prefix"
    for deb in "$dl"/*.deb; do dpkg-deb -x "$deb" "$prefix" || die "unpacking $deb failed"; done
    rm -rf "$dl"
fi
[ -d "$build/include" ] && [ -d "$common/include" ] || die "headers of $pkg unpacked but $build or $common is missing"
mkdir -p "$moddir"
ln -sfn "$build" "$moddir/build"
ln -sfn "$common" "$moddir/source"
log "WARNING: no headers package for kernel $kver; using those of $pkg, unpacked into $prefix. BPF programs that only use pt_regs and tracepoints work; clang may print harmless header warnings."
