#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 and the CuTe DSL it compiles with) for the device, which has no
# network. Packed with xz it is ~72 MB, over the device call's 64 MiB carry, so it travels in two
# parts over two calls of one warm machine and is unpacked in a third:
#   tools/fa4_kit.sh build                 # here: .fa4kit/part-00 and .fa4kit_b/part-01
#   call 1, carry [".fa4kit"]:             tools/fa4_kit.sh stage
#   call 2, carry [".fa4kit_b", ...]:      tools/fa4_kit.sh stage
#   any later call on the same machine:    source tools/fa4_kit.sh unpack   (then flash_attn.cute imports)
# The parts wait in /tmp/fa4stage on the device; a machine given back loses them.
KIT_PACKAGES=(flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
              nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1)
case ${1:-} in
build)
    set -euo pipefail
    work=$(mktemp -d)
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        -d "$work/wheels" -q "${KIT_PACKAGES[@]}"
    mkdir -p "$work/site"
    for wheel in "$work"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$work/site"; done
    # apache-tvm-ffi and torch-c-dlpack-ext come with the .devkit (tilelang needs them too); a call
    # without the .devkit finds them missing, so take them from its site.tar.xz when it is there
    if [ -f .devkit/site.tar.xz ]; then
        tar -xJf .devkit/site.tar.xz -C "$work" --wildcards 'site/tvm_ffi*' 'site/apache_tvm_ffi*' 'site/torch_c_dlpack_ext*'
    fi
    tar -cf - -C "$work" site | xz -6 -T0 > "$work/fa4site.tar.xz"
    rm -rf .fa4kit .fa4kit_b && mkdir -p .fa4kit .fa4kit_b
    split -b 36M -d "$work/fa4site.tar.xz" .fa4kit/part-
    mv .fa4kit/part-01 .fa4kit_b/
    du -b .fa4kit/* .fa4kit_b/*
    rm -rf "$work"
    ;;
stage)
    mkdir -p /tmp/fa4stage && cp .fa4kit*/part-* /tmp/fa4stage/ && ls -l /tmp/fa4stage
    ;;
unpack)
    if [ ! -d /tmp/fa4/site ]; then
        ls /tmp/fa4stage/part-00 /tmp/fa4stage/part-01 >/dev/null || return 1
        mkdir -p /tmp/fa4 && cat /tmp/fa4stage/part-* | xz -d | tar -x -C /tmp/fa4 || return 1
    fi
    # the CuTe DSL's own packages sit one folder down (its wheel's .pth file, which PYTHONPATH skips)
    export PYTHONPATH=/tmp/fa4/site:/tmp/fa4/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
    ;;
*)
    echo "usage: tools/fa4_kit.sh build | stage | unpack (sourced)" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
