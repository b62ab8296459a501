#!/usr/bin/env bash
# Step time, per-kernel times and peak memory of one size at one sequence length on one GPU (or TP),
# random init on the embedded corpus, each micro-batch one full-length sequence:
#   launch/benchmark.sh 0.8B 131072 tilelang        # or fla, torch
#   launch/benchmark.sh 0.8B 8192 tilelang,fla      # alternate backends step by step, log ratios
#   TP=2 launch/benchmark.sh 0.8B 131072 tilelang   # tensor parallel over 2 GPUs (SP=1: sequence parallel too)
#   TAG=nooverlap launch/benchmark.sh 0.8B 32768 tilelang +deepspeed.overrides.zero_optimization.overlap_comm=false
# TP (default 1) ranks split each layer's heads; NUM_GPUS (default TP) processes start, by torchrun
# when more than one, so NUM_GPUS / TP ranks are data parallel. Extra arguments are Hydra overrides.
# Writes $RUNS/<size>-<tokens>-<backend>[-tp<TP>[sp]][-<N>gpu][-<TAG>]/metrics.jsonl (its last line is the
# run summary) and copies it, with any profile-stepN.txt (benchmark.profile_step=N), to $OUT when set.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:?usage: launch/benchmark.sh SIZE TOKENS BACKEND[,BACKEND] [overrides...]}
TOKENS=${2:?tokens per sequence}
BACKEND=${3:?tilelang, fla, torch, or a comma list to compare}
shift 3
TP=${TP:-1}
SP=${SP:-0}
NUM_GPUS=${NUM_GPUS:-$TP}
NAME=${SIZE}-${TOKENS}-${BACKEND/,/_vs_}
SEQUENCE_PARALLEL=false
if [ "$TP" -gt 1 ]; then
    NAME=$NAME-tp$TP
    if [ "$SP" = 1 ]; then
        SEQUENCE_PARALLEL=true
        NAME=${NAME}sp
    fi
fi
if [ "$NUM_GPUS" -ne "$TP" ]; then
    NAME=$NAME-${NUM_GPUS}gpu
fi
NAME=$NAME${TAG:+-$TAG}   # TAG: tells apart runs of one size, length and backend with other overrides
RUN_DIR=${RUNS:-runs/benchmark}/$NAME
PYTHON=${PYTHON:-python3}
if [ "$NUM_GPUS" -gt 1 ]; then
    LAUNCH=("$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NUM_GPUS")
else
    LAUNCH=("$PYTHON")
fi
if [ "$TOKENS" -gt 32768 ]; then
    PRESET=continue_pretrain_128k   # activation checkpointing on
else
    PRESET=h200_single
fi
if [[ "$BACKEND" == *,* ]]; then
    BACKEND_ARGS=("benchmark.compare_backends=[$BACKEND]")
    STEPS=${STEPS:-16}
else
    BACKEND_ARGS=("model.gdn_backend=$BACKEND")
    STEPS=${STEPS:-10}
fi
rm -rf "$RUN_DIR"
"${LAUNCH[@]}" train/pretrain.py experiment=$PRESET model=$SIZE "${BACKEND_ARGS[@]}" \
    parallel.tp=$TP parallel.sequence_parallel=$SEQUENCE_PARALLEL \
    train.tokens_per_micro_batch=$TOKENS train.seq_len=$TOKENS data.document_boundaries=false \
    train.steps=$STEPS train.warmup_steps=2 benchmark.kernel_timing=true benchmark.warmup_steps=2 \
    train.checkpoint_every=0 train.checkpoint_at_exit=false train.export_hf=false logger.mode=disabled \
    run_dir="$RUN_DIR" "$@"
if [ -n "${OUT:-}" ]; then
    cp "$RUN_DIR/metrics.jsonl" "$OUT/metrics-$NAME.jsonl"
    for profile in "$RUN_DIR"/profile-step*.txt; do   # from benchmark.profile_step=N
        if [ -f "$profile" ]; then cp "$profile" "$OUT/$NAME-$(basename "$profile")"; fi
    done
fi
