#!/usr/bin/env bash
# One node, every visible GPU (or NUM_GPUS of them). Arguments are Hydra overrides:
#   launch/single_node.sh experiment=h200_single
#   NUM_GPUS=8 launch/single_node.sh model=2B experiment=continue_pretrain_128k model.init_from=/ckpt/Qwen3.5-2B
#   NUM_GPUS=8 launch/single_node.sh model=9B experiment=continue_pretrain_128k parallel.tp=2 parallel.sequence_parallel=true
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
GPUS=${NUM_GPUS:-$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")}
exec "$PYTHON" -m deepspeed.launcher.runner --num_gpus "$GPUS" --master_port "${MASTER_PORT:-29500}" train/pretrain.py "$@"
