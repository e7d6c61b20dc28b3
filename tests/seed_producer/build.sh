#!/usr/bin/env bash
# Build the seed-style C++ producer (seed_producer.cpp) into OUTDIR and print the binary's path.
#
#   tests/seed_producer/build.sh [OUTDIR]      # default OUTDIR: a new temporary directory
#
# Needs a C++ compiler ($CXX, else g++, c++ or clang++), cuda.h from a CUDA toolkit
# ($CUDA_HOME, $CUDA_PATH, /usr/local/cuda, /usr/local/cuda-*, /opt/cuda) and libcuda to link
# with -lcuda (the toolkit's stub library, or the driver's). Nothing is written outside OUTDIR.
# Exits 77 with "SKIP: <reason>" on stderr when one of them is missing; a compile error exits
# with the compiler's status.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(mktemp -d -t seed-producer-XXXXXX)}
mkdir -p "$out"

skip() {
    echo "SKIP: $*" >&2
    exit 77
}

cxx=${CXX:-}
if [ -z "$cxx" ]; then
    for c in g++ c++ clang++; do
        if command -v "$c" >/dev/null 2>&1; then
            cxx=$c
            break
        fi
    done
fi
[ -n "$cxx" ] || skip "no C++ compiler found (g++, c++ or clang++; or set CXX)"

root=""
for d in ${CUDA_HOME:-} ${CUDA_PATH:-} /usr/local/cuda /usr/local/cuda-* /opt/cuda; do
    if [ -f "$d/include/cuda.h" ]; then
        root=$d
        break
    fi
done
[ -n "$root" ] || skip "no cuda.h found (looked in \$CUDA_HOME, \$CUDA_PATH, /usr/local/cuda*, /opt/cuda)"

# -lcuda: the toolkit's stub (its soname is libcuda.so.1, so the driver's library is the one
# loaded at run time), else the driver's own libcuda.so, else its libcuda.so.1 by name.
arch=$(uname -m)
link=()
for d in "$root/lib64/stubs" "$root/lib/stubs" "$root/targets/$arch-linux/lib/stubs"; do
    if [ -f "$d/libcuda.so" ]; then
        link=("-L$d" -lcuda)
        break
    fi
done
if [ ${#link[@]} -eq 0 ]; then
    libs=$(/sbin/ldconfig -p 2>/dev/null || ldconfig -p 2>/dev/null || true)
    dev=$(printf '%s\n' "$libs" | awk '$1 == "libcuda.so" {print $NF; exit}')
    so1=$(printf '%s\n' "$libs" | awk '$1 == "libcuda.so.1" {print $NF; exit}')
    if [ -n "$dev" ]; then
        link=("-L$(dirname "$dev")" -lcuda)
    elif [ -n "$so1" ]; then
        link=("-L$(dirname "$so1")" -l:libcuda.so.1)
    fi
fi
[ ${#link[@]} -gt 0 ] || skip "no libcuda to link with (no stub in $root and no CUDA driver installed)"

"$cxx" -std=c++17 -O2 -Wall -Wextra -I"$root/include" "$here/seed_producer.cpp" \
    -o "$out/seed_producer" "${link[@]}"
echo "$out/seed_producer"
