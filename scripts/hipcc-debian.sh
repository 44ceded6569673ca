#!/usr/bin/env bash
# A HIP compiler for Debian 12 without ROCm (CI), given to the build as PEERCOMM_HIPCC:
#   PEERCOMM_HIPCC=$PWD/scripts/hipcc-debian.sh cargo build --features hip
# Needs Debian's hipcc libamdhip64-dev clang-19 lld-19 llvm-19 (scripts/install-toolchains.sh).
#
# Debian's hipcc is HIP 5.2 on clang 15, which knows gfx90a but not gfx942. Each compile
# is tried with that hipcc first, then with clang++-19 --rocm-path=/usr over a device-
# library folder: links to Debian's bitcode (/usr/lib/<triple>/amdgcn/bitcode) plus,
# where Debian has none, oclc_isa_version_<N>.bc for the requested gfx9 processor,
# derived from the gfx940 file by changing its ISA version constant (9400 -> 9402 for
# gfx942) with llvm-dis-19/llvm-as-19. The folder is target/hip-device-libs
# (PEERCOMM_HIP_DEVICE_LIBS overrides). Code objects built this way serve compile and
# disassembly checks; on an AMD machine, build with its ROCm.
#
# Arguments are the compiler's (build_hip.rs passes --offload-arch=<arch> ... -c SRC -o OUT).
# `hipcc-debian.sh --prepare ARCH...` only makes the folder ready for those architectures.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
libs=${PEERCOMM_HIP_DEVICE_LIBS:-$repo/target/hip-device-libs}

tool19() { # the LLVM 19 program $1: NAME-19 on PATH, else /usr/lib/llvm-19/bin/NAME
  command -v "$1-19" || { [ -x "/usr/lib/llvm-19/bin/$1" ] && echo "/usr/lib/llvm-19/bin/$1"; }
}

# Makes $libs hold Debian's device libraries plus the ISA file of architecture $1.
prepare() {
  local arch=$1 sys="" d
  for d in /usr/lib/*/amdgcn/bitcode; do
    if [ -f "$d/ocml.bc" ]; then sys=$d; break; fi
  done
  if [ -z "$sys" ]; then
    echo "hipcc-debian: no /usr/lib/<triple>/amdgcn/bitcode/ocml.bc (Debian's HIP device libraries)" >&2
    return 1
  fi
  if [ ! -d "$libs" ]; then
    # Built aside, then renamed: the architectures compile in parallel.
    mkdir -p "$(dirname "$libs")"
    local tmp
    tmp=$(mktemp -d "$libs.XXXXXX")
    chmod 755 "$tmp"
    ln -s "$sys"/* "$tmp"/
    mv -T "$tmp" "$libs" 2>/dev/null || rm -rf "$tmp"
  fi
  local processor=${arch%%:*}
  local digits=${processor#gfx}
  local isa=$libs/oclc_isa_version_$digits.bc
  [ -e "$isa" ] && return 0
  # gfx9XY: major 9, minor X, stepping Y (hex digits): version 9000 + 100*X + Y.
  if ! [[ $processor =~ ^gfx9([0-9a-fA-F])([0-9a-fA-F])$ ]]; then
    echo "hipcc-debian: no device library for $arch and only gfx9 ones are derived" >&2
    return 1
  fi
  local version=$((9000 + 100 * 16#${BASH_REMATCH[1]} + 16#${BASH_REMATCH[2]}))
  local template=$sys/oclc_isa_version_940.bc dis as text
  [ -f "$template" ] || { echo "hipcc-debian: $template is missing" >&2; return 1; }
  dis=$(tool19 llvm-dis) || { echo "hipcc-debian: no llvm-dis-19" >&2; return 1; }
  as=$(tool19 llvm-as) || { echo "hipcc-debian: no llvm-as-19" >&2; return 1; }
  text=$("$dis" "$template" -o -)
  if [[ $text != *"i32 9400"* ]]; then
    echo "hipcc-debian: $template does not hold the constant 9400" >&2
    return 1
  fi
  local tmp_ll=$libs/isa_$digits.$$.ll tmp_bc=$libs/isa_$digits.$$.bc.tmp
  printf '%s\n' "${text//i32 9400/i32 $version}" >"$tmp_ll"
  "$as" "$tmp_ll" -o "$tmp_bc"
  mv "$tmp_bc" "$isa"
  rm -f "$tmp_ll"
}

if [ "${1:-}" = --prepare ]; then
  shift
  for arch in "$@"; do prepare "$arch"; done
  echo "hipcc-debian: device libraries for $* in $libs"
  exit 0
fi

arch=""
for a in "$@"; do
  case $a in --offload-arch=*) arch=${a#--offload-arch=} ;; esac
done

hipcc_err=$(mktemp)
trap 'rm -f "$hipcc_err"' EXIT
if command -v hipcc >/dev/null && hipcc "$@" 2>"$hipcc_err"; then
  exit 0
fi
clang=$(tool19 clang++) || {
  echo "hipcc-debian: hipcc failed and there is no clang++-19" >&2
  cat "$hipcc_err" >&2
  exit 1
}
if [ -z "$arch" ]; then
  echo "hipcc-debian: hipcc failed and no --offload-arch was given for clang++-19" >&2
  cat "$hipcc_err" >&2
  exit 1
fi
prepare "$arch"
if "$clang" --rocm-path=/usr --rocm-device-lib-path="$libs" "$@"; then
  exit 0
fi
echo "hipcc-debian: (hipcc before it:)" >&2
head -n 3 "$hipcc_err" >&2
exit 1
