#!/usr/bin/env bash
# Install CRIU 4.1.1 (built from Debian's verified source tarball) and its pycriu bindings.
#
# Idempotent: a working criu 4.x on PATH (or in $PREFIX/sbin) is kept; the build is cached in
# $GYM_FORK_CACHE; pycriu is (re)installed into $PYTHON only when it does not import.
#
#   sudo gym-fork install-criu                       (from an installed gym_fork: this file ships in it)
#   PYTHON=.venv/bin/python scripts/install_criu.sh  (in a checkout: a wrapper that runs this file)
#
# Why from source: Debian bookworm's criu 3.17 fails on recent kernels
# ("vdso: Unexpected rt vDSO area bounds"); 4.1.x works.  The orig tarball comes from Debian's
# trixie *source* archive through apt, and its SHA256 is checked against apt's signed Sources index.
# The patches in criu-patches/*.patch next to this file are applied before the build (see the README there:
# without 0001, CRIU 4.1.1 cannot dump any TCP/UDP socket on Linux >= 6.16).  Each patch names a
# "Marker:" string that ends up in the binary; an installed criu lacking one is rebuilt.
set -euo pipefail

CRIU_VERSION=4.1.1
DEB_VERSION=4.1.1-1
# Also verified against the signed index at run time; this pin guards against a changed index.
ORIG_SHA256_PREFIX=f80a66cb
PREFIX=${PREFIX:-/usr/local}
PYTHON=${PYTHON:-python3}
# make -C changes directory: a relative interpreter path must become absolute.
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON");; *) PYTHON=$(command -v "$PYTHON");; esac
CACHE=${GYM_FORK_CACHE:-$HOME/.cache/gym_fork}
# CRIU caches its kernel-feature probe (criu.kdat) only on a tmpfs; /run is ext4 on some
# machines, which costs ~35 ms on *every* dump and restore.  So our build keeps the cache in a
# root-only tmpfs of its own (mounted here and, after a reboot, by gym_fork itself).
KDAT_DIR=/run/gym_fork-criu
PATCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/criu-patches
[ -d "$PATCH_DIR" ] || { echo "[install_criu] ERROR: $PATCH_DIR is missing (reinstall gym_fork: the patches ship with it)" >&2; exit 1; }
PATCHES=()
for p in "$PATCH_DIR"/*.patch; do [ -f "$p" ] && PATCHES+=("$p"); done
MARKERS=()
for p in "${PATCHES[@]}"; do
  m=$(sed -n 's/^Marker: *//p' "$p" | head -1)
  [ -n "$m" ] && MARKERS+=("$m")
done
# The build dir name changes with the patch set, so a cached unpatched build is never reused.
PATCH_ID=$(cat /dev/null "${PATCHES[@]}" | sha256sum | cut -c1-8)
SRC_DIR=$CACHE/criu-$CRIU_VERSION-kdat-p$PATCH_ID
CRIU_BIN=$PREFIX/sbin/criu

log() { echo "[install_criu] $*" >&2; }
die() { echo "[install_criu] ERROR: $*" >&2; exit 1; }

criu_ok() {  # $1 = binary; true when it is 4.x and `criu check` passes
  local bin=$1 ver
  [ -x "$bin" ] || return 1
  ver=$("$bin" --version 2>/dev/null | sed -n 's/^Version: \([0-9]*\)\..*/\1/p')
  [ "${ver:-0}" -ge 4 ] || return 1
  [ "$(id -u)" != 0 ] && return 0          # `criu check` needs root; nonroot use is probed by doctor
  "$bin" check >/dev/null 2>&1
}

criu_patched() {  # $1 = binary; true when every patch marker is compiled in
  local m
  for m in "${MARKERS[@]}"; do grep -qaF "$m" "$1" || return 1; done
}

pycriu_ok() { "$PYTHON" -c 'import pycriu, pycriu.rpc_pb2' >/dev/null 2>&1; }

ensure_kdat_tmpfs() {  # root only; harmless when the binary was not built with our KDAT_DIR
  [ "$(id -u)" = 0 ] || return 0
  mkdir -p -m 0700 "$KDAT_DIR"
  mountpoint -q "$KDAT_DIR" || mount -t tmpfs -o size=1m,mode=0700 gym_fork-criu-kdat "$KDAT_DIR" \
    || log "note: could not mount a tmpfs at $KDAT_DIR; CRIU will re-probe the kernel on every call"
}

existing=""
for cand in "$(command -v criu 2>/dev/null || true)" "$CRIU_BIN"; do
  if [ -n "$cand" ] && criu_ok "$cand"; then existing=$cand; break; fi
done
if [ "$existing" = "$CRIU_BIN" ] && [ "$(id -u)" = 0 ] && ! grep -qa "$KDAT_DIR/criu.kdat" "$CRIU_BIN"; then
  log "$CRIU_BIN is an earlier gym_fork build without the kdat cache dir: rebuilding"
  existing=""
fi
if [ -n "$existing" ] && ! criu_patched "$existing"; then
  if [ "$(id -u)" = 0 ]; then
    log "$existing lacks the patches in $PATCH_DIR (TCP/UDP sockets do not dump on Linux >= 6.16): building a patched criu into $CRIU_BIN"
    existing=""
  else
    log "warning: $existing lacks the patches in $PATCH_DIR; on Linux >= 6.16 it cannot dump TCP/UDP sockets. Rerun as root to build a patched criu."
  fi
fi

if [ -n "$existing" ] && pycriu_ok; then
  ensure_kdat_tmpfs
  log "criu OK: $existing ($("$existing" --version | head -1)); pycriu imports"
  exit 0
fi

if [ -z "$existing" ] || [ ! -d "$SRC_DIR/lib/pycriu" ] || [ ! -f "$SRC_DIR/lib/pycriu/rpc_pb2.py" ]; then
  if [ "$(id -u)" != 0 ]; then
    die "criu 4.x is not installed and building it needs root (apt build deps, $PREFIX/sbin).
  Ask an administrator to run:  sudo $PYTHON -m gym_fork.cli install-criu
  (the same as:  sudo PYTHON=$PYTHON bash $0)
  or put a working criu >= 4.0 on PATH and re-run this script (no root needed then: CRIU runs in an
  unprivileged user namespace; check with \`gym-fork doctor\`).
  Meanwhile gym_fork works for this user in fork-only mode (in-memory copy-on-write snapshots)."
  fi
  export DEBIAN_FRONTEND=noninteractive
  src_list=/etc/apt/sources.list.d/gym-fork-criu-trixie-src.sources
  if [ ! -f "$src_list" ]; then
    # A *source-only* trixie entry, same mirror and keyring as the machine's bookworm entry.
    # Never add a trixie binary line: apt would upgrade libc and friends.
    uris=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    keyring=$(sed -n 's/^Signed-By: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)
    uris=${uris:-http://deb.debian.org/debian}
    keyring=${keyring:-/usr/share/keyrings/debian-archive-keyring.gpg}
    printf 'Types: deb-src\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
      "$uris" "$keyring" > "$src_list"
    log "added $src_list"
  fi
  log "apt-get update"
  apt-get update -qq
  log "installing build dependencies (from bookworm)"
  apt-get install -y -qq --no-install-recommends -t bookworm \
    build-essential pkg-config xz-utils ca-certificates libprotobuf-c-dev protobuf-c-compiler \
    libprotobuf-dev protobuf-compiler libnl-3-dev libnet1-dev libcap-dev libbsd-dev uuid-dev \
    libnftables-dev libgnutls28-dev iproute2 patch >/dev/null

  mkdir -p "$CACHE/dl"
  tarball=$CACHE/dl/criu_$CRIU_VERSION.orig.tar.xz
  if [ ! -f "$tarball" ]; then
    chown _apt "$CACHE/dl" 2>/dev/null || true
    # The .dsc/.debian.tar.xz 404 on this mirror, so apt-get exits 100: only the tarball matters.
    (cd "$CACHE/dl" && set +e && apt-get source -qq --download-only "criu=$DEB_VERSION" >/dev/null 2>&1; true)
    [ -f "$tarball" ] || die "could not download criu_$CRIU_VERSION.orig.tar.xz via apt-get source"
  fi
  want=$(apt-cache showsrc criu | awk -v v="$DEB_VERSION" -v f="criu_$CRIU_VERSION.orig.tar.xz" '
      /^Package:/ {inpar=0} $1=="Version:" {inpar=($2==v)} /^Checksums-Sha256:/ {insha=1; next}
      /^[A-Z]/ {insha=0} inpar && insha && $3==f {print $1; exit}')
  got=$(sha256sum "$tarball" | cut -d' ' -f1)
  [ -n "$want" ] || die "no SHA256 for $DEB_VERSION in apt's Sources index"
  [ "$got" = "$want" ] || { rm -f "$tarball"; die "checksum mismatch for $tarball: $got != $want"; }
  case $got in $ORIG_SHA256_PREFIX*) ;; *) die "tarball checksum $got does not match the pinned $ORIG_SHA256_PREFIX…";; esac
  log "source verified: sha256 $got"

  if [ ! -x "$SRC_DIR/criu/criu" ] || [ ! -f "$SRC_DIR/lib/pycriu/rpc_pb2.py" ]; then
    rm -rf "$SRC_DIR"; mkdir -p "$SRC_DIR"
    tar -xf "$tarball" -C "$SRC_DIR" --strip-components=1
    for p in "${PATCHES[@]}"; do
      log "applying $(basename "$p")"
      patch -s -p1 -d "$SRC_DIR" <"$p" || { rm -rf "$SRC_DIR"; die "patch $p does not apply to criu $CRIU_VERSION"; }
    done
    log "building criu $CRIU_VERSION (about 20 s)"
    make -s -C "$SRC_DIR" -j"$(nproc)" PYTHON="$PYTHON" RUNDIR="$KDAT_DIR" criu lib >"$CACHE/criu-build.log" 2>&1 \
      || { tail -30 "$CACHE/criu-build.log" >&2; die "criu build failed; full log: $CACHE/criu-build.log"; }
    for old in "$CACHE"/criu-"$CRIU_VERSION"-kdat*; do  # builds for another patch set
      [ "$old" = "$SRC_DIR" ] || rm -rf "$old"
    done
  fi
  if [ -z "$existing" ]; then
    criu_patched "$SRC_DIR/criu/criu" || die "the build in $SRC_DIR lacks the patch markers (${MARKERS[*]})"
    install -D -m755 "$SRC_DIR/criu/criu" "$CRIU_BIN"
    existing=$CRIU_BIN
    log "installed $CRIU_BIN"
  fi
fi

if ! pycriu_ok; then
  [ -d "$SRC_DIR/lib/pycriu" ] || die "pycriu sources missing in $SRC_DIR (rerun as root to build them)"
  log "installing pycriu into $PYTHON"
  "$PYTHON" -m pip install -q 'protobuf>=3.20,<7' 'setuptools>=61' wheel
  # --no-build-isolation: lib/pyproject.toml wants protobuf<4 at build time, which we do not need.
  "$PYTHON" -m pip install -q --no-build-isolation "$SRC_DIR/lib"
fi
pycriu_ok || die "pycriu does not import in $PYTHON"
ensure_kdat_tmpfs
if [ "$(id -u)" = 0 ]; then
  "$existing" check >/dev/null 2>&1 || die "'$existing check' fails: $("$existing" check 2>&1 | tail -3)"
fi
log "criu OK: $existing ($("$existing" --version | head -1)); pycriu installed"
