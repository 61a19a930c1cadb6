#!/usr/bin/env bash
# Finds or installs LLVM/MLIR 22 and exports what melior / mlir-sys need to build Kiln.
#
#   source ./env-llvm.sh      # in a shell, before cargo
#
# Idempotent: when everything is present it only checks and exports (well under a second).
# Debian 12 ships LLVM/MLIR 22 as llvm-22-dev, libmlir-22-dev, mlir-22-tools, clang-22 and
# libpolly-22-dev (static Polly is listed by llvm-config and needed to link); linking also needs
# libzstd-dev, libz3-dev, libxml2-dev and zlib1g-dev. Set KILN_LLVM_PREFIX to use an LLVM 22
# installed elsewhere (it must contain bin/llvm-config and the MLIR C API static libraries).

kiln_llvm_setup() {
    local prefix="${KILN_LLVM_PREFIX:-/usr/lib/llvm-22}"
    local packages="llvm-22-dev libmlir-22-dev mlir-22-tools clang-22 libpolly-22-dev libzstd-dev libz3-dev libxml2-dev zlib1g-dev"
    local missing=""

    if [ -z "${KILN_LLVM_PREFIX:-}" ] && command -v dpkg-query >/dev/null 2>&1; then
        local p
        for p in $packages; do
            if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
                missing="$missing $p"
            fi
        done
    fi

    if [ -n "$missing" ]; then
        echo "env-llvm.sh: installing$missing" >&2
        local sudo=""
        if [ "$(id -u)" -ne 0 ]; then
            if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
                echo "env-llvm.sh: need root (or sudo) to install:$missing" >&2
                return 1
            fi
        fi
        if ! $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing >/dev/null 2>&1; then
            $sudo apt-get update -qq >/dev/null 2>&1 || true
            if ! $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing >&2; then
                echo "env-llvm.sh: could not install$missing" >&2
                return 1
            fi
        fi
    fi

    if [ ! -x "$prefix/bin/llvm-config" ]; then
        echo "env-llvm.sh: $prefix/bin/llvm-config not found (install LLVM 22 or set KILN_LLVM_PREFIX)" >&2
        return 1
    fi
    local version
    version="$("$prefix/bin/llvm-config" --version)"
    case "$version" in
        22.*) ;;
        *) echo "env-llvm.sh: $prefix has LLVM $version, Kiln needs 22.x" >&2; return 1 ;;
    esac
    if [ ! -f "$prefix/include/mlir-c/IR.h" ] || ! ls "$prefix"/lib/libMLIRCAPIIR.a >/dev/null 2>&1; then
        echo "env-llvm.sh: MLIR C API headers or static libraries missing under $prefix (libmlir-22-dev)" >&2
        return 1
    fi

    export MLIR_SYS_220_PREFIX="$prefix"
    export TABLEGEN_220_PREFIX="$prefix"
    export LIBCLANG_PATH="$prefix/lib"
    # MLIR and LLVM are linked statically; the rpath covers builds against shared LLVM
    # libraries (MLIR_SYS_LINK_SHARED=1) so the binary runs without LD_LIBRARY_PATH. For the
    # default prefix the same flag is in .cargo/config.toml, so sourcing this file or not gives
    # the same build.
    if [ "$prefix" != "/usr/lib/llvm-22" ]; then
        export RUSTFLAGS="${RUSTFLAGS:-} -C link-arg=-Wl,-rpath,$prefix/lib"
    fi
    if ! command -v cc >/dev/null 2>&1; then
        echo "env-llvm.sh: no C compiler driver (cc) found; Kiln links kernels with it (apt-get install gcc)" >&2
        return 1
    fi
    return 0
}

if kiln_llvm_setup; then
    unset -f kiln_llvm_setup
    # When executed rather than sourced, say what would be exported.
    if [ "${BASH_SOURCE[0]}" = "$0" ]; then
        echo "LLVM/MLIR 22 ready at $MLIR_SYS_220_PREFIX (source this file to export the build variables)"
    fi
else
    unset -f kiln_llvm_setup
    # shellcheck disable=SC2317
    return 1 2>/dev/null || exit 1
fi
