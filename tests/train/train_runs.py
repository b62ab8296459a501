"""Running train/pretrain.py in subprocesses on CPU, for the training tests: the environment
(W&B offline in the test's directory), the cpu_smoke overrides, the launch commands and the
per-step records of metrics.jsonl."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRETRAIN = str(REPO / "train" / "pretrain.py")


def pretrain_env(workdir: Path) -> dict:
    env = dict(os.environ)
    wandb_dir = str(workdir / "wandb_home")
    env.update(
        WANDB_MODE="offline", WANDB_DIR=wandb_dir, WANDB_CONFIG_DIR=wandb_dir, WANDB_CACHE_DIR=wandb_dir,
        WANDB_DATA_DIR=wandb_dir, WANDB_SILENT="true", PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
    )
    return env


def smoke_overrides(workdir: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "experiment=cpu_smoke", f"run_dir={run_dir}", f"data.cache_dir={workdir / 'data_cache'}",
        "data.embedded_documents=300", "train.tokens_per_micro_batch=512", "train.seq_len=256",
        "train.warmup_steps=2", *extra,
    ]


def torchrun_command(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_command(command: list[str], workdir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=REPO, env=pretrain_env(workdir), capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        print(result.stdout[-4000:], result.stderr[-8000:], sep="\n")
    return result


def step_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]
