#!/usr/bin/env bash
# Step time, per-kernel times and peak memory of one size at one sequence length on one GPU,
# random init on the embedded corpus, each micro-batch one full-length sequence:
#   launch/benchmark.sh 0.8B 131072 tilelang        # or fla, torch
#   launch/benchmark.sh 0.8B 8192 tilelang,fla      # alternate backends step by step, log ratios
# Extra arguments are Hydra overrides. Writes $RUNS/<size>-<tokens>-<backend>/metrics.jsonl (its
# last line is the run summary) and copies it to $OUT when that is set.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${1:?usage: launch/benchmark.sh SIZE TOKENS BACKEND[,BACKEND] [overrides...]}
TOKENS=${2:?tokens per sequence}
BACKEND=${3:?tilelang, fla, torch, or a comma list to compare}
shift 3
RUN_DIR=${RUNS:-runs/benchmark}/${SIZE}-${TOKENS}-${BACKEND/,/_vs_}
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
"${PYTHON:-python3}" train/pretrain.py experiment=$PRESET model=$SIZE "${BACKEND_ARGS[@]}" \
    train.tokens_per_micro_batch=$TOKENS train.seq_len=$TOKENS data.document_boundaries=false \
    train.steps=$STEPS train.warmup_steps=2 benchmark.kernel_timing=true benchmark.warmup_steps=2 \
    train.checkpoint_every=0 train.checkpoint_at_exit=false train.export_hf=false logger.mode=disabled \
    run_dir="$RUN_DIR" "$@"
if [ -n "${OUT:-}" ]; then
    cp "$RUN_DIR/metrics.jsonl" "$OUT/metrics-${SIZE}-${TOKENS}-${BACKEND/,/_vs_}.jsonl"
fi
