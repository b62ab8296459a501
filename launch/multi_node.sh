#!/usr/bin/env bash
# Several nodes through DeepSpeed's launcher, which starts the ranks over passwordless ssh (pdsh).
# The hostfile lists one node per line as "hostname slots=GPUS"; this checkout, its Python
# environment and the run directory must be at the same paths on every node (a shared file
# system), so that checkpoints written by every rank land in one place.
#   HOSTFILE=hosts.txt launch/multi_node.sh model=9B deepspeed=zero3 run_dir=/shared/runs/9b-cpt train.resume=auto
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${HOSTFILE:?set HOSTFILE to a file of lines 'hostname slots=N'}
MASTER_ADDR=${MASTER_ADDR:-$(awk 'NF && $1 !~ /^#/ {print $1; exit}' "$HOSTFILE")}
exec "${PYTHON:-python3}" -m deepspeed.launcher.runner --hostfile "$HOSTFILE" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    train/pretrain.py "$@"
