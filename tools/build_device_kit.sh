#!/usr/bin/env bash
# Build .devkit/ from nothing on the CPU machine: what a new checkout needs before its first device call.
#   tools/build_device_kit.sh            # 30-56 min on 2 cores (FlashQLA's half is the slow one); prints the carry's size
#   KERNELS_ONLY=1 tools/build_device_kit.sh   # our kernels alone (no training stack, no FLA or FlashQLA cache):
#                                        # what the kernel comparisons need, ~20 min + ~2.3 min a form, 49 MiB of carry
# Candidate forms of the fused reverse walk in .devkit/alt/backward_fused_*.py (tools/device_session.sh's
# fused-*:FORM parts) are compiled into the cache too.
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
KERNELS_ONLY=${KERNELS_ONLY:-0}
training=(hydra-core==1.3.8 omegaconf==2.3.1 deepspeed==0.19.8)
[ "$KERNELS_ONLY" = 1 ] && training=()
"$PY" ../shared/device/make_kit.py tilelang==0.1.15 fla-core==0.6.0 flash-qla==0.1.3 "${training[@]}" \
    > "$WORK/kit.log" 2>&1 &
kit=$!
forms=$(ls .devkit/alt/backward_fused_*.py 2>/dev/null | paste -sd, || true)
skip_fla=()
[ "$KERNELS_ONLY" = 1 ] && skip_fla=(--skip-fla)
TILELANG_CACHE_DIR=$WORK/ours "$PY" tools/precompile_kernels.py --merge '' --skip-flashqla "${skip_fla[@]}" \
    --fused-forms "$forms" --out "$WORK/ours.tgz" > "$WORK/ours.log" 2>&1 &
ours=$!
jobs_=("kit $kit" "ours $ours")
parts=$WORK/ours.tgz
if [ "$KERNELS_ONLY" != 1 ]; then
    TILELANG_CACHE_DIR=$WORK/flashqla "$PY" tools/precompile_kernels.py --merge '' --skip-ours --skip-fla \
        --out "$WORK/flashqla.tgz" > "$WORK/flashqla.log" 2>&1 &
    jobs_+=("flashqla $!")
    parts=$parts,$WORK/flashqla.tgz
fi
failed=0
for job in "${jobs_[@]}"; do
    set -- $job
    wait "$2" || { echo "build_device_kit.sh: $1 failed, see $WORK/$1.log" >&2; failed=1; }
done
[ $failed -eq 0 ] || exit 1

# nothing left to compile: precompile_kernels.py only unpacks both parts and packs them as one
TILELANG_CACHE_DIR=$WORK/merged "$PY" tools/precompile_kernels.py --sets '' --skip-ours --skip-fla --skip-flashqla \
    --merge "$parts" --out .devkit/tlcache.tgz > "$WORK/merge.log" 2>&1
rm -f .devkit/tritoncache.tgz
echo "TileLang cache: $(ls "$WORK/merged"/*/*/kernels | wc -l) entries"
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb | tail -1 | cut -f1)
kit_bytes=$(du -cb .devkit/* | tail -1 | cut -f1)
echo "carry: $(( (tree + kit_bytes) / 1048576 )) MiB of 64 (.devkit $(( kit_bytes / 1048576 )) MiB)"
