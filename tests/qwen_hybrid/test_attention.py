"""qwen_hybrid.attention: each backend against float64 attention computed document by document, the
choice `auto` makes, and the errors for a backend that cannot run."""
import pytest
import torch

from qwen_hybrid.attention import FA4ForwardCudnnBackward, attention_kernels, causal_attention, fa4_unavailable_reason
from qwen_hybrid.config import QwenHybridConfig
from qwen_hybrid.layers import DocumentLayout

# the 0.8B model's attention heads; documents of 1 and 0 tokens and lengths off the 64/128 tiles
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 256
RAGGED = [1, 700, 0, 64, 2047, 129, 1500]


def reference(q, k, v, bounds) -> torch.Tensor:
    """float64 causal softmax attention of each document [start, end) alone, GQA by repeating k, v."""
    q, k, v = (t[0].double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = torch.zeros_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        scores = torch.einsum("thd,shd->hts", q[start:end], k[start:end]) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        out[start:end] = torch.einsum("hts,shd->thd", scores.softmax(-1), v[start:end])
    return out.unsqueeze(0)


def inputs(lengths, device, dtype, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lengths)
    q = torch.randn(1, tokens, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    k = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    v = torch.randn(1, tokens, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=gen)
    bounds = torch.tensor([0, *lengths]).cumsum(0)
    return q, k, v, DocumentLayout.build(bounds, device), bounds.tolist()


def worst_error_per_document(got, want, bounds) -> list[float]:
    """Largest |got - want| of each non-empty document over its heads and dims, relative to the
    tensor's largest |want| (a 1-token document's dq is exactly 0; NaN counts as inf)."""
    diff = (got.double() - want).abs().nan_to_num(nan=float("inf"))[0]
    scale = want.abs().max().clamp_min(1e-30)
    return [(diff[start:end].max() / scale).item() for start, end in zip(bounds[:-1], bounds[1:]) if end > start]


def test_cpu_packs_match_float64_attention_per_document():
    q, k, v, documents, bounds = inputs([5, 1, 0, 17, 9], "cpu", torch.float64)
    got = causal_attention(q, k, v, documents, backend="auto")
    assert max(worst_error_per_document(got, reference(q, k, v, bounds), bounds)) < 1e-12
    # one document: the dense path
    q, k, v, documents, bounds = inputs([23], "cpu", torch.float64)
    got = causal_attention(q, k, v, documents, backend="sdpa")
    assert max(worst_error_per_document(got, reference(q, k, v, bounds), bounds)) < 1e-12


def test_fa4_refuses_what_it_cannot_run():
    q, k, v, documents, _ = inputs([4, 4], "cpu", torch.float32)
    with pytest.raises(ValueError, match="attention_backend='fa4': FlashAttention-4 runs on CUDA devices, got cpu"):
        causal_attention(q, k, v, documents, backend="fa4")
    with pytest.raises(ValueError, match="attention backend must be one of .*got 'flash'"):
        causal_attention(q, k, v, documents, backend="flash")
    assert "bfloat16 or float16" in fa4_unavailable_reason(torch.device("cuda"), torch.float32)
    assert "head dims 8-256" in fa4_unavailable_reason(torch.device("cuda"), torch.bfloat16, 320)
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        QwenHybridConfig.named("tiny", attention_backend="fa3")


def test_auto_picks_fa4_for_packs_and_its_forward_for_long_documents(monkeypatch):
    """Which kernel `auto` runs by shape, on a machine where FA4 is made to look available."""
    import qwen_hybrid.attention as attention

    calls = []
    monkeypatch.setattr(attention, "fa4_unavailable_reason", lambda *args: None)
    monkeypatch.setattr(attention, "_fa4", lambda q, k, v, documents: calls.append(
        "fa4 varlen" if documents is not None else "fa4 dense") or q)
    monkeypatch.setattr(attention.FA4ForwardCudnnBackward, "apply", lambda q, k, v: calls.append("fa4 + cudnn") or q)
    monkeypatch.setattr(attention, "_sdpa_backends", lambda q, k, v, documents: calls.append("sdpa") or q)

    def run(lengths, backend="auto"):
        tokens = sum(lengths)
        q = torch.zeros(1, tokens, 1, 8)
        documents = DocumentLayout.build(torch.tensor([0, *lengths]).cumsum(0), "cpu")
        causal_attention(q, q, q, documents, backend)

    run([100, 50])
    run([attention.FA4_FORWARD_MIN_TOKENS])
    run([attention.FA4_FORWARD_MIN_TOKENS - 1])
    run([attention.FA4_FORWARD_MIN_TOKENS], backend="fa4")
    run([100, 50], backend="sdpa")
    assert calls == ["fa4 varlen", "fa4 + cudnn", "sdpa", "fa4 dense", "sdpa"]


def test_the_run_log_says_which_attention_kernels_run(monkeypatch):
    """attention_kernels: what each backend runs here, and why "auto" left FlashAttention-4 out."""
    import qwen_hybrid.attention as attention

    cpu = torch.device("cpu")
    assert attention_kernels("sdpa", cpu, torch.bfloat16, 256).startswith("sdpa: torch SDPA")
    assert "FlashAttention-4 not used: FlashAttention-4 runs on CUDA devices, got cpu" in attention_kernels(
        "auto", cpu, torch.bfloat16, 256)
    assert "cannot run" in attention_kernels("fa4", cpu, torch.bfloat16, 256)
    with pytest.raises(ValueError, match="attention backend must be one of .*got 'flash'"):
        attention_kernels("flash", cpu, torch.bfloat16, 256)
    monkeypatch.setattr(attention, "fa4_unavailable_reason", lambda *args: None)
    described = attention_kernels("auto", cpu, torch.bfloat16, 256)
    assert "FlashAttention-4 for a pack" in described and f">= {attention.FA4_FORWARD_MIN_TOKENS} tokens" in described
    assert attention_kernels("fa4", cpu, torch.bfloat16, 256) == "fa4: FlashAttention-4 for every pack"


def errors_against_float64(runs: dict, lengths, seed: int) -> dict:
    """{name: {"out" | "dq" | "dk" | "dv": worst error per document}} of each run(q, k, v, documents)
    against float64 autograd on the same bf16 inputs and output gradient."""
    reason = fa4_unavailable_reason(torch.device("cuda"), torch.bfloat16, HEAD_DIM)
    if reason is not None:
        pytest.skip(reason)
    q, k, v, documents, bounds = inputs(lengths, "cuda", torch.bfloat16, seed=seed)
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16,
                           generator=torch.Generator("cuda").manual_seed(seed + 1))
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = reference(*leaves64, bounds)
    want.backward(grad_out.double())
    errors = {}
    for name, run in runs.items():
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves, documents)
        out.backward(grad_out)
        errors[name] = {"out": worst_error_per_document(out, want.detach(), bounds)}
        for label, leaf, leaf64 in zip("qkv", leaves, leaves64):
            errors[name][f"d{label}"] = worst_error_per_document(leaf.grad, leaf64.grad, bounds)
    return errors


def assert_within_bounds_and_sdpa(errors: dict, name: str) -> None:
    """Each of `name`'s worst errors < 2e-2 and no larger than 1.5x the sdpa backend's (+1e-3)."""
    for label, per_document in errors[name].items():
        worst, sdpa_worst = max(per_document), max(errors["sdpa"][label])
        print(f"{label}: {name} worst {worst:.3e} (per document {[f'{e:.1e}' for e in per_document]}), "
              f"sdpa {sdpa_worst:.3e}")
        assert worst < 2e-2, f"{label}: {name}'s worst error {worst:.3e} per document {per_document}"
        assert worst <= 1.5 * sdpa_worst + 1e-3, f"{label}: {name} {worst:.3e} against sdpa {sdpa_worst:.3e}"


def _sdpa(q, k, v, documents):
    return causal_attention(q, k, v, documents, backend="sdpa")


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [RAGGED, [4096]], ids=["ragged", "one_document"])
def test_fa4_matches_float64_attention_and_its_gradients(lengths):
    """FlashAttention-4's output and q/k/v gradients against float64 autograd, document by document;
    no worse than 1.5x the error of the sdpa backend (cuDNN, varlen_attn) on the same inputs."""
    fa4 = lambda q, k, v, documents: causal_attention(q, k, v, documents, backend="fa4")  # noqa: E731
    assert_within_bounds_and_sdpa(errors_against_float64({"fa4": fa4, "sdpa": _sdpa}, lengths, seed=1), "fa4")


@pytest.mark.gpu
def test_fa4_forward_with_cudnn_backward_matches_float64_attention():
    """auto's kernel for one long document (at 3000 tokens here): FA4's forward, cuDNN's backward from
    FA4's log-sum-exp. Against float64 autograd, no worse than 1.5x the sdpa backend's error."""
    fa4_cudnn = lambda q, k, v, documents: FA4ForwardCudnnBackward.apply(q, k, v)  # noqa: E731
    errors = errors_against_float64({"fa4+cudnn": fa4_cudnn, "sdpa": _sdpa}, [3000], seed=3)
    assert_within_bounds_and_sdpa(errors, "fa4+cudnn")
