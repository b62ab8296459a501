#!/usr/bin/env bash
# Build .devkit/ from nothing on the CPU machine: what a new checkout needs before its first device call.
#   tools/build_device_kit.sh            # 17 min on 2 cores; prints the carry's size at the end
# 1. the baselines into .venv without their dependencies (fla-core needs Triton to import, which the
#    CPU machine lacks; the precompile reads only its TileLang file, and FlashQLA's kernels);
# 2. the device's missing packages (../shared/device/make_kit.py; omegaconf pinned for hydra-core 1.3.8);
# 3. the TileLang cache in two processes side by side (ours and FLA's; FlashQLA's, the slow half), each
#    in its own folder, merged into .devkit/tlcache.tgz (by precompile_kernels.py --merge).
# Needs the venv of README's test command (.venv). Leaves .devkit/tritoncache.tgz out: with the
# TileLang cache it would pass the 64 MiB carry, and bench-warm compiles FLA's Triton kernels anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "build_device_kit.sh: no .venv (run README's test command first)" >&2; exit 2; }
WORK=${WORK:-/tmp/device_kit}
rm -rf "$WORK" && mkdir -p "$WORK" .devkit

.venv/bin/pip install -q --no-deps flash-qla==0.1.3 fla-core==0.6.0
"$PY" ../shared/device/make_kit.py tilelang==0.1.15 fla-core==0.6.0 flash-qla==0.1.3 \
    hydra-core==1.3.8 omegaconf==2.3.1 deepspeed==0.19.8 > "$WORK/kit.log" 2>&1 &
kit=$!
TILELANG_CACHE_DIR=$WORK/ours "$PY" tools/precompile_kernels.py --merge '' --skip-flashqla \
    --out "$WORK/ours.tgz" > "$WORK/ours.log" 2>&1 &
ours=$!
TILELANG_CACHE_DIR=$WORK/flashqla "$PY" tools/precompile_kernels.py --merge '' --skip-ours --skip-fla \
    --out "$WORK/flashqla.tgz" > "$WORK/flashqla.log" 2>&1 &
flashqla=$!
failed=0
for job in "kit $kit" "ours $ours" "flashqla $flashqla"; do
    set -- $job
    wait "$2" || { echo "build_device_kit.sh: $1 failed, see $WORK/$1.log" >&2; failed=1; }
done
[ $failed -eq 0 ] || exit 1

# nothing left to compile: precompile_kernels.py only unpacks both parts and packs them as one
TILELANG_CACHE_DIR=$WORK/merged "$PY" tools/precompile_kernels.py --sets '' --skip-ours --skip-fla --skip-flashqla \
    --merge "$WORK/ours.tgz,$WORK/flashqla.tgz" --out .devkit/tlcache.tgz > "$WORK/merge.log" 2>&1
rm -f .devkit/tritoncache.tgz
echo "TileLang cache: $(ls "$WORK/merged"/*/*/kernels | wc -l) entries"
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
kit_bytes=$(du -cb .devkit/* | tail -1 | cut -f1)
echo "carry: $(( (tree + kit_bytes) / 1048576 )) MiB of 64 (.devkit $(( kit_bytes / 1048576 )) MiB)"
