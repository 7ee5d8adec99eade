#!/usr/bin/env bash
# Local set-up for the C++ runtime (cpp/): build tools, nlohmann-json, Catch2, and ONNX Runtime
# headers + library under third_party/onnxruntime (include/ + lib/), which cpp/ takes as
# -DONNXRUNTIME_ROOT.
#
# ONNX Runtime headers are in neither Debian 12 nor the onnxruntime wheel. Debian 13 (trixie)
# packages them as libonnxruntime-dev: its .deb is downloaded through a private apt
# configuration (nothing from trixie is installed, the system's sources are not touched) and
# unpacked with dpkg -x. The library linked and loaded at run time is the onnxruntime wheel's
# own libonnxruntime.so.1.x (the ORT C API is versioned: headers of 1.21 work with a 1.32 library).
#
# Idempotent; run as root on Debian 12 (or 13). Environment:
#   ORT_LIB=/path/libonnxruntime.so.1.x   library to link (default: the wheel's, found through
#                                          $PYTHON or the project's .venv)
#   ORT_DEB=/path/libonnxruntime-dev.deb   use this package file instead of downloading it
#   SKIP_APT_INSTALL=1                     do not apt-get install the build dependencies
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/third_party/onnxruntime"
CACHE="$ROOT/third_party/.cache"
mkdir -p "$DEST/lib" "$CACHE"

say() { echo "cpp_setup: $*"; }
die() { echo "error: $*" >&2; exit 1; }

SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null && SUDO="sudo" || die "run as root (or install sudo)"
fi

# 1. Debian packages: compiler, cmake, JSON library, test framework, strace (the hostile-bundle
#    tests record every file the C++ runtime opens with it), the aarch64 cross tools.
PKGS=(g++ make cmake nlohmann-json3-dev catch2 libssl-dev ca-certificates strace)
# on x86-64, an aarch64 cross compiler and qemu-user: tests/test_ops_aarch64.py runs the kernels'
# aarch64 build under emulation and compares its bits with this machine's
if [ "$(uname -m)" = x86_64 ]; then PKGS+=(g++-aarch64-linux-gnu qemu-user); fi
if [ "${SKIP_APT_INSTALL:-0}" != 1 ]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    say "build packages already installed"
  fi
fi

# 2. ONNX Runtime headers from Debian 13's libonnxruntime-dev, unpacked, not installed.
if [ -f "$DEST/include/onnxruntime_c_api.h" ]; then
  say "headers already in $DEST/include"
else
  deb="${ORT_DEB:-}"
  if [ -z "$deb" ]; then
    deb="$(ls "$CACHE"/libonnxruntime-dev_*.deb 2>/dev/null | head -n1 || true)"
  fi
  if [ -z "$deb" ]; then
    APTDIR="$CACHE/apt"
    mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial" "$APTDIR/etc/preferences.d"
    KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
    [ -f /usr/share/keyrings/debian-archive-trixie-automatic.gpg ] || true
    cat >"$APTDIR/sources.list" <<SRC
deb [signed-by=$KEYRING] http://deb.debian.org/debian trixie main
SRC
    APTOPTS=(-o "Dir::Etc::SourceList=$APTDIR/sources.list" -o "Dir::Etc::SourceParts=-"
             -o "Dir::Etc::Preferences=$APTDIR/etc/preferences" -o "Dir::Etc::PreferencesParts=$APTDIR/etc/preferences.d"
             -o "Dir::State::Lists=$APTDIR/lists" -o "Dir::Cache=$APTDIR/cache"
             -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "APT::Get::List-Cleanup=0"
             -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
    say "fetching the trixie package list (private apt dir $APTDIR)"
    apt-get "${APTOPTS[@]}" update -qq || die "apt-get update for trixie failed"
    arch="$(dpkg --print-architecture)"
    (cd "$CACHE" && apt-get "${APTOPTS[@]}" download "libonnxruntime-dev:$arch") \
      || die "apt-get download libonnxruntime-dev failed"
    deb="$(ls "$CACHE"/libonnxruntime-dev_*.deb | head -n1)"
  fi
  say "unpacking $(basename "$deb")"
  tmp="$(mktemp -d)"
  dpkg -x "$deb" "$tmp"
  hdr="$(dirname "$(find "$tmp" -name onnxruntime_c_api.h | head -n1)")"
  [ -n "$hdr" ] && [ -f "$hdr/onnxruntime_c_api.h" ] || die "no onnxruntime_c_api.h in $deb"
  rm -rf "$DEST/include"
  mkdir -p "$DEST/include"
  cp -r "$hdr"/. "$DEST/include/"
  rm -rf "$tmp"
fi

# 3. The library: the onnxruntime wheel's libonnxruntime.so.1.x, linked as libonnxruntime.so.
lib="${ORT_LIB:-}"
if [ -z "$lib" ]; then
  py="${PYTHON:-}"
  [ -z "$py" ] && [ -x "$ROOT/.venv/bin/python" ] && py="$ROOT/.venv/bin/python"
  [ -z "$py" ] && py="$(command -v python3 || true)"
  [ -n "$py" ] || die "no python to find the onnxruntime wheel; set ORT_LIB"
  capi="$("$py" -c 'import onnxruntime, os; print(os.path.join(os.path.dirname(onnxruntime.__file__), "capi"))' 2>/dev/null)" \
    || die "python ($py) has no onnxruntime package; pip install onnxruntime or set ORT_LIB"
  lib="$(ls "$capi"/libonnxruntime.so.1.* 2>/dev/null | head -n1)"
fi
[ -f "$lib" ] || die "ONNX Runtime library not found: '$lib'"
ln -sfn "$lib" "$DEST/lib/$(basename "$lib")"
ln -sfn "$(basename "$lib")" "$DEST/lib/libonnxruntime.so"
# Also the soname (libonnxruntime.so.1) for the loader.
soname="$(objdump -p "$lib" 2>/dev/null | awk '/SONAME/{print $2}')"
if [ -n "$soname" ] && [ "$soname" != "$(basename "$lib")" ]; then
  ln -sfn "$(basename "$lib")" "$DEST/lib/$soname"
fi
say "ONNX Runtime: headers $DEST/include, library $lib"
say "configure with: cmake -S cpp -B cpp/build -DONNXRUNTIME_ROOT=$DEST"
