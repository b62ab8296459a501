"""DeepSpeed ZeRO-2 engines on CPU (one gloo rank), for tests/train/test_zero_step.py: one step on
a small model with DeepSpeed's own gradient checks and with train.zero_step's, in float32 and
bfloat16, with every gradient finite and with one entry NaN or inf (on the last rank only). One
JSON line per case, from rank 0. Each rank takes its share of one batch, so the averaged gradient is
the whole batch's at any world size.

    python tests/train/zero_step_run.py   (or under torchrun, several ranks)"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def reason_without_norm() -> str | None:
    """What streamline_zero_step says to an engine that computes no gradient norm."""
    import deepspeed

    from train.zero_step import streamline_zero_step

    model = torch.nn.Linear(8, 8)
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters()),
        config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0, "steps_per_print": 2**31 - 1,
                "zero_optimization": {"stage": 2, "compute_grad_norm": False}},
        dist_init_required=False)
    return streamline_zero_step(engine.optimizer)


def one_step(dtype_name: str, streamlined: bool, poison: str) -> dict:
    import deepspeed

    from train.zero_step import streamline_zero_step

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40),
                                torch.nn.LayerNorm(40), torch.nn.Linear(40, 7))
    batch = torch.randn(64, 48)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    x = batch.chunk(world)[rank]
    # the gradient norm in float64 of the whole batch's loss, on a float64 copy of the model
    reference = [p.detach().double().requires_grad_() for p in model.parameters()]
    copy64 = torch.func.functional_call(
        model.double(), dict(zip([n for n, _ in model.named_parameters()], reference)), (batch.double(),))
    grads64 = torch.autograd.grad((copy64 ** 2).mean() * 50, reference)
    reference_norm = torch.stack([g.norm() for g in grads64]).norm().item()
    model.float()
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        config={"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
                "bf16": {"enabled": dtype == torch.bfloat16}, "steps_per_print": 2**31 - 1,
                "zero_optimization": {"stage": 2, "contiguous_gradients": True, "overlap_comm": False}},
        dist_init_required=False)
    reason = streamline_zero_step(engine.optimizer) if streamlined else "not asked"
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    out = engine(x.to(dtype))
    loss = (out.float() ** 2).mean() * 50
    if poison != "none" and rank == world - 1:
        bad = float(poison)
        # one entry of the last layer's bias gradient becomes bad, the rest stay finite
        engine.module[-1].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), bad))
    engine.backward(loss)
    engine.step()
    after = [p.detach().float() for p in engine.module.parameters()]
    norm = engine.get_global_grad_norm()
    return {
        "dtype": dtype_name, "world": world, "streamlined": streamlined, "poison": poison, "reason": reason,
        "norm": None if norm is None else float(norm),
        "reference_norm": reference_norm,
        "skipped_steps": engine.skipped_steps,
        "changed": any(not torch.equal(a, b) for a, b in zip(before, after)),
        "finite": all(bool(torch.isfinite(a).all()) for a in after),
        "params": [a.flatten()[:64].tolist() for a in after],
    }


if __name__ == "__main__":
    from train.pretrain import init_distributed

    init_distributed()
    reason = reason_without_norm()
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"without_norm": reason}), flush=True)
    for dtype_name in ("float32", "bfloat16"):
        for streamlined in (False, True):
            for poison in ("none", "nan", "inf"):
                row = one_step(dtype_name, streamlined, poison)
                if torch.distributed.get_rank() == 0:
                    print(json.dumps(row), flush=True)
    # every rank leaves the group before it exits: a rank exiting with gloo's threads still running
    # was killed by std::terminate once in CI ("terminate called without an active exception")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
