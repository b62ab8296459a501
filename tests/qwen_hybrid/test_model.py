"""The hybrid model on its own: packed sequences, config errors, the chunked loss, checkpointing."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from flashqla.testing import relative_error
from qwen_hybrid import QwenHybridConfig, QwenHybridForCausalLM
from qwen_hybrid.config import NAMED_SIZES
from qwen_hybrid.layers import AttentionCore, CausalConv1d, GatedDeltaRule
from qwen_hybrid.loss import chunked_cross_entropy


def tiny_model(seed: int = 0, **overrides) -> QwenHybridForCausalLM:
    torch.manual_seed(seed)
    model = QwenHybridForCausalLM(QwenHybridConfig.named("tiny", gdn_backend="torch", **overrides)).eval()
    with torch.no_grad():  # non-trivial norms, gates and decays
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def test_packed_documents_equal_each_document_alone():
    model = tiny_model()
    lengths = [37, 0, 50, 3]  # an empty document and one shorter than the conv kernel
    docs = [torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(i)) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        packed_out = model(packed, cu_seqlens=cu_seqlens, labels=packed, return_logits=True)
        alone = [model(doc, labels=doc, return_logits=True) for doc in docs if doc.shape[1] > 0]
    expected_logits = torch.cat([out.logits for out in alone], dim=1)
    assert relative_error(packed_out.logits, expected_logits) <= 1e-5
    # the packed loss is the token-weighted mean of the per-document losses (n - 1 targets each)
    targets = [n - 1 for n in lengths if n > 0]
    expected_loss = sum(out.loss * t for out, t in zip(alone, targets)) / sum(targets)
    assert abs(packed_out.loss.item() - expected_loss.item()) <= 1e-5 * expected_loss.item()

    # and without cu_seqlens the documents would see each other
    with torch.no_grad():
        unmasked = model(packed).logits
    assert relative_error(unmasked, expected_logits) > 1e-3


def test_causal_conv_restarts_at_document_boundaries():
    conv = CausalConv1d(channels=6, kernel_size=4)  # with SiLU
    lengths = [5, 1, 0, 9]
    x = torch.randn(1, sum(lengths), 6)
    position_in_doc = torch.cat([torch.arange(n) for n in lengths])
    expected = torch.cat([conv(part) for part in x.split(lengths, dim=1) if part.shape[1] > 0], dim=1)
    assert torch.allclose(conv(x, position_in_doc), expected, atol=1e-6)
    # a token's output only depends on the kernel_size - 1 tokens before it
    shifted = torch.cat([torch.zeros(1, 3, 6), x], dim=1)
    assert torch.allclose(conv(shifted)[:, 3:], conv(x), atol=1e-6)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_attention_heads=6, num_key_value_heads=4), "num_key_value_heads"),
        (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_key_heads"),
        (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
         r"layer_types\[1\]"),
        (dict(layer_types=["linear_attention"] * 3), "layer_types"),
        (dict(gdn_backend="triton"), "gdn_backend"),
        (dict(hidden_size=0), "hidden_size"),
        (dict(partial_rotary_factor=0.01), "partial_rotary_factor"),
    ],
)
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        QwenHybridConfig.named("tiny", **overrides)


def test_bad_hf_configs_are_refused():
    base = QwenHybridConfig.named("tiny").to_hf()
    with pytest.raises(ValueError, match="rope_type"):
        QwenHybridConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="hidden_act"):
        QwenHybridConfig.from_hf({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        QwenHybridConfig.from_hf({**base, "linear_num_value_heads": 5})


def test_bad_inputs_are_refused():
    model = tiny_model()
    ids = torch.randint(0, 512, (2, 10))
    with pytest.raises(ValueError, match="B = 1"):
        model(ids, cu_seqlens=torch.tensor([0, 5, 10]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(ids[:1], cu_seqlens=torch.tensor([0, 5, 9]))
    with pytest.raises(ValueError, match="labels"):
        model(ids, labels=ids[:, :5])


@pytest.mark.parametrize("size", ["0.8B", "2B", "4B", "9B", "27B"])
def test_named_sizes_have_their_parameter_counts(size):
    config = QwenHybridConfig.named(size)
    assert config.layer_types.count("full_attention") == config.num_hidden_layers // 4
    with torch.device("meta"):
        model = QwenHybridForCausalLM(config)
    count = sum(p.numel() for p in model.parameters())  # tied weights count once
    nominal = float(size.removesuffix("B")) * 1e9
    # the names round the text tower's size (Qwen3.5's own names also count the vision tower)
    assert 0.6 * nominal <= count <= 1.1 * nominal, count


def test_named_rejects_unknown_size():
    with pytest.raises(ValueError, match="size must be one of"):
        QwenHybridConfig.named("7B")
    assert set(NAMED_SIZES) == {"tiny", "0.8B", "2B", "4B", "9B", "27B"}


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
def test_chunked_cross_entropy_matches_full_cross_entropy(chunk_size):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    weight = torch.randn(33, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 33, (50,), generator=generator)
    labels[::4] = -100
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size)
    grads = torch.autograd.grad(loss * 3.0, (hidden, weight))
    expected = F.cross_entropy(hidden @ weight.t(), labels, ignore_index=-100)
    expected_grads = torch.autograd.grad(expected * 3.0, (hidden, weight))
    assert torch.allclose(loss, expected, rtol=1e-12)
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)


def test_chunked_cross_entropy_bf16_gradients_stay_accurate_for_confident_rows():
    """bf16 takes the fast backward (softmax in the logits' dtype); rows whose target has p ~ 1
    must keep their small p - 1, which rounding the softmax first would destroy."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(64, 32, generator=generator).to(torch.bfloat16)
    weight = (torch.randn(500, 32, generator=generator) / 4).to(torch.bfloat16)
    labels = torch.randint(0, 500, (64,), generator=generator)
    hidden[:8] = (weight[labels[:8]].float() * 8).to(torch.bfloat16)  # p(target) close to 1 on 8 rows
    labels[-4:] = -100

    def grads(h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = chunked_cross_entropy(h, w, labels, chunk_size=24)
        return (loss, *torch.autograd.grad(loss, (h, w)))

    loss, grad_hidden, grad_weight = grads(hidden, weight)
    ref_loss, ref_hidden, ref_weight = grads(hidden.double(), weight.double())
    probabilities = torch.softmax(hidden.double() @ weight.double().t(), -1)
    assert (probabilities[torch.arange(8), labels[:8]] > 0.99).sum() >= 6
    assert relative_error(loss, ref_loss) <= 1e-3
    assert relative_error(grad_hidden, ref_hidden) <= 1e-2
    assert relative_error(grad_weight, ref_weight) <= 1e-2
    assert relative_error(grad_hidden[:8], ref_hidden[:8]) <= 2e-2


def test_chunked_cross_entropy_with_every_label_ignored_is_zero():
    hidden = torch.randn(8, 4, requires_grad=True)
    weight = torch.randn(5, 4, requires_grad=True)
    loss = chunked_cross_entropy(hidden, weight, torch.full((8,), -100))
    loss.backward()
    assert loss.item() == 0.0 and hidden.grad.abs().sum() == 0 and weight.grad.abs().sum() == 0


def test_labels_give_loss_without_logits_by_default():
    model = tiny_model()
    ids = torch.randint(0, 512, (1, 12))
    out = model(ids, labels=ids)
    assert out.logits is None and out.loss.dim() == 0
    assert model(ids).logits.shape == (1, 12, 512) and model(ids).loss is None


@pytest.mark.parametrize("recompute_attention", [True, False], ids=["recompute_attention", "keep_attention"])
def test_activation_checkpointing_gives_the_same_gradients(recompute_attention):
    from qwen_hybrid.layers import AttentionCore

    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    grads, attention_calls = [], []
    for enabled in (False, True):
        model = tiny_model(seed=5).double()
        model.set_activation_checkpointing(enabled, recompute_attention=recompute_attention)
        calls = []
        for module in model.modules():
            if isinstance(module, AttentionCore):
                module.register_forward_hook(lambda *_: calls.append(1))
        model(ids, cu_seqlens=torch.tensor([0, 15, 40]), labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        attention_calls.append(len(calls))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-12, atol=1e-14, msg=name)
    layers = model.config.layer_types.count("full_attention")
    # the backward recomputes each attention layer's kernel, or keeps its outputs and runs none
    expected = [layers, 2 * layers if recompute_attention else layers]
    assert attention_calls == expected, f"attention kernel calls without/with checkpointing: {attention_calls}, expected {expected}"


def test_keeping_the_first_attention_layers_recomputes_only_the_others():
    """keep_attention_tensors(n) (train.recompute_attention=auto's switch): the first n checkpointed
    attention layers keep their kernel's tensors, the backward recomputes the kernel of the others
    only, the gradients are those of recomputing all; a count past the checkpointed layers is refused."""
    from qwen_hybrid.layers import AttentionCore

    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(7))
    grads, calls_per_layer = [], []
    for kept in (0, 1, 2):
        model = tiny_model(seed=8).double()
        model.set_activation_checkpointing(True)
        model.keep_attention_tensors(kept)
        calls = []
        cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
        for index, core in enumerate(cores):
            core.register_forward_hook(lambda *_, index=index: calls.append(index))
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        calls_per_layer.append([calls.count(i) for i in range(len(cores))])
    for other in grads[1:]:
        for name in grads[0]:
            torch.testing.assert_close(other[name], grads[0][name], rtol=1e-12, atol=1e-14, msg=name)
    assert calls_per_layer == [[2, 2], [1, 2], [1, 1]], f"attention kernel calls per layer: {calls_per_layer}"
    with pytest.raises(ValueError, match=r"layers must be an integer in \[0, 2\].*got 3"):
        model.keep_attention_tensors(3)
    model.set_activation_checkpointing(True, layers=2)  # only the first attention layer is checkpointed
    assert [layer.self_attn.checkpoint_around_attention for layer in model.model.layers[1::2]] == [False, False]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        model.keep_attention_tensors(2)
    model.keep_attention_tensors(1)
    model.set_activation_checkpointing(False)  # nothing checkpointed: nothing keeps around its kernel
    assert [layer.self_attn.checkpoint_around_attention for layer in model.model.layers[1::2]] == [False, False]


def test_kept_attention_bytes_follow_the_heads_and_tokens():
    model = tiny_model()
    attention = model.model.layers[1].self_attn
    per_token = 6 * attention.num_heads * attention.head_dim + 3 * model.config.hidden_size
    assert model.kept_attention_bytes(1000) == 1000 * per_token * 4  # float32 weights
    assert model.to(torch.bfloat16).kept_attention_bytes(1000) == 1000 * per_token * 2
    # under ZeRO-3 a parameter is empty between its uses and keeps its shape as ds_shape
    heads = (attention.num_heads, attention.num_kv_heads)
    for linear in (attention.o_proj, attention.k_proj):
        linear.weight.ds_shape = linear.weight.shape
        linear.weight.data = torch.empty(0, dtype=linear.weight.dtype)
    assert (attention.num_heads, attention.num_kv_heads) == heads
    assert model.kept_attention_bytes(1000) == 1000 * per_token * 2
    gdn = model.model.layers[0].linear_attn
    heads = (gdn.num_v_heads, gdn.num_k_heads)
    gdn.A_log.ds_shape = gdn.A_log.shape
    gdn.A_log.data = torch.empty(0, dtype=gdn.A_log.dtype)
    assert (gdn.num_v_heads, gdn.num_k_heads) == heads


def test_kept_attention_bytes_bound_what_keeping_the_attention_tensors_keeps(monkeypatch):
    """What a forward keeps alive for the backward (tensors saved by autograd, and those the
    checkpoints hold), with the attention kernel replaced by one that saves what the CUDA kernels
    save (q, k, v, out and the float32 log-sum-exp): keeping both attention layers' tensors adds at
    most kept_attention_bytes a layer, and no less than 60 % of it (the estimate is not vacuous)."""
    import gc

    from qwen_hybrid.layers import AttentionCore

    class SavesLikeTheKernels(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out = q * 1.0
            ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
            return out

        @staticmethod
        def backward(ctx, grad):
            _, k, v, _, _ = ctx.saved_tensors
            return grad, torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(AttentionCore, "forward", lambda self, q, k, v, documents=None: SavesLikeTheKernels.apply(q, k, v))
    model = tiny_model().to(torch.bfloat16)
    model.set_activation_checkpointing(True)
    tokens = 4096
    ids = torch.randint(0, 512, (1, tokens), generator=torch.Generator().manual_seed(9))

    def bytes_kept():
        storages = {}

        def count(tensor):
            storages.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            return tensor

        gc.collect()
        with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
            loss = model(ids, labels=ids).loss
        for obj in gc.get_objects():  # what the checkpoints hold as their inputs
            if torch.is_tensor(obj):
                count(obj)
        del loss
        return sum(storages.values())

    recomputing = bytes_kept()
    model.keep_attention_tensors(2)
    per_layer = (bytes_kept() - recomputing) / 2
    estimate = model.kept_attention_bytes(tokens)
    assert 0.6 * estimate <= per_layer <= estimate, (per_layer, estimate)


def test_checkpointing_some_layers_gives_the_same_gradients_and_recomputes_only_those():
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(4))
    grads, recomputed = [], []
    for layers in (None, 1):
        model = tiny_model(seed=6).double()
        model.set_activation_checkpointing(True, layers=layers)
        forwards = []
        for index, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, index=index: forwards.append(index))
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
        recomputed.append(sorted(set(i for i in forwards if forwards.count(i) > 1)))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-12, atol=1e-14, msg=name)
    assert recomputed == [[0, 1, 2, 3], [0]], f"layers run twice (recomputed): {recomputed}"
    with pytest.raises(ValueError, match=r"layers must be None or an integer in \[0, 4\], got 5"):
        model.set_activation_checkpointing(True, layers=5)


def _record_keep_choices(monkeypatch) -> list[bool]:
    """The keep_for_backward of every GDN op call the model makes from here on, in order."""
    import flashqla
    from qwen_hybrid import layers

    op = flashqla.chunk_gated_delta_rule
    passes = []

    def recording_op(*args, keep_for_backward=True, **kwargs):
        passes.append(keep_for_backward)
        return op(*args, keep_for_backward=keep_for_backward, **kwargs)

    monkeypatch.setattr(layers.flashqla, "chunk_gated_delta_rule", recording_op)
    return passes


def test_checkpointed_passes_make_the_same_keep_choice(monkeypatch):
    """A non-reentrant checkpoint needs its recomputation to save exactly the tensors its first pass
    saved: the GDN op must not keep its intermediates in one pass and not the other (an H200 run
    with recompute_for_backward() around the first pass only failed with CheckpointError). The
    choice is now the op's keep_for_backward argument: every pass must pass the same one."""
    passes = _record_keep_choices(monkeypatch)
    model = tiny_model(seed=5)
    model.set_activation_checkpointing(True)
    ids = torch.randint(0, 512, (1, 20))
    model(ids, labels=ids).loss.backward()
    assert len(passes) == 4 and len(set(passes)) == 1, (
        f"keep_for_backward per GDN call: {passes}, expected one value in 4 calls (2 layers, each run and recomputed)"
    )


@pytest.mark.parametrize("keep", [True, "inverse", False])
def test_gdn_keep_for_backward_reaches_the_op(monkeypatch, keep):
    passes = _record_keep_choices(monkeypatch)
    model = tiny_model(seed=5, gdn_keep_for_backward=keep)
    ids = torch.randint(0, 512, (1, 12))
    model(ids, labels=ids).loss.backward()
    assert passes == [keep, keep], f"keep_for_backward per GDN call: {passes}, expected [{keep}, {keep}]"


def test_kernel_calls_go_through_parameter_free_modules():
    model = tiny_model()
    rules = [m for m in model.modules() if isinstance(m, GatedDeltaRule)]
    cores = [m for m in model.modules() if isinstance(m, AttentionCore)]
    assert len(rules) == 2 and len(cores) == 2
    assert all(not list(m.parameters()) for m in rules + cores)
    assert all(rule.backend == "torch" for rule in rules)
    calls = []
    for module in rules + cores:
        module.register_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    model(torch.randint(0, 512, (1, 9)))
    assert sorted(calls) == ["AttentionCore"] * 2 + ["GatedDeltaRule"] * 2


def test_layers_expose_head_counts():
    model = tiny_model()
    gdn = model.model.layers[0].linear_attn
    attention = model.model.layers[1].self_attn
    assert (gdn.num_k_heads, gdn.num_v_heads) == (2, 4)
    assert (attention.num_heads, attention.num_kv_heads) == (4, 2)


PACK_LENGTHS = (700, 1, 300)  # a one-token document between two long ones
# (logits of each document, loss, every gradient) against the float64 model on each document
# alone. float64: the norms and gates still compute in float32, measured up to 3.3e-8 (logits) and
# 1.2e-7 (gradients); float32: 1.1e-6 and 2.5e-6. bf16 on an H200, tilelang and fla: 2.3e-2
# (logits), 9.4e-5 (loss), 5.0e-2 (gradients); an op ignoring cu_seqlens or zeroing the
# one-token document moves that document's logits by 1.06 and 0.92.
CPU_TOLERANCES = {torch.float64: (1e-6, 1e-6, 1e-5), torch.float32: (1e-5, 1e-5, 2e-5)}
BF16_TOLERANCES = (6e-2, 1e-3, 1e-1)


def leaky_model(backend: str = "torch") -> QwenHybridForCausalLM:
    """The tiny model with 128-wide heads (the GPU kernels' shape), weights ~N(0, 0.08^2) and slow
    GDN decay (exp(A_log) = 0.01): the state lasts hundreds of tokens and dominates the block's
    output, so a document that sees its predecessor's state, or a one-token document whose GDN
    output is dropped, moves its logits by O(1). (With HF's init the state decays within a few
    tokens: an op ignoring cu_seqlens moved the logits by 2.3e-5.) Same weights for every backend."""
    config = QwenHybridConfig.named(
        "tiny", linear_key_head_dim=128, linear_value_head_dim=128, head_dim=128, gdn_backend=backend
    )
    torch.manual_seed(0)
    model = QwenHybridForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(math.log(0.01))
            elif param.dim() == 1:
                offset = 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + offset)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.08)
    return model


def _pack() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (1, sum(PACK_LENGTHS)), generator=generator)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(PACK_LENGTHS)], dtype=torch.int32)
    probe = torch.randn(1, ids.shape[1], 512, generator=generator, dtype=torch.float64) * 0.05
    return ids, cu_seqlens, probe


def _logits_loss_and_gradients(model, ids, cu_seqlens, probe):
    """Logits, the summed token loss and the gradients of it + <probe, logits>, in float64 on the
    CPU (the probe reaches the one-token document, whose token predicts nothing)."""
    device = next(model.parameters()).device
    out = model(ids.to(device), cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(device),
                labels=ids.to(device), return_logits=True)
    num_targets = ids.shape[1] - (1 if cu_seqlens is None else len(cu_seqlens) - 1)
    loss_sum = out.loss.double() * num_targets
    model.zero_grad(set_to_none=True)
    (loss_sum + (out.logits.double() * probe.to(device)).sum()).backward()
    grads = {name: param.grad.detach().double().cpu() for name, param in model.named_parameters()}
    return out.logits.detach().double().cpu(), loss_sum.detach().cpu(), grads


@functools.lru_cache(maxsize=1)
def _float64_documents_alone():
    """The float64 torch model run on each document of the pack alone: logits, loss sum, gradients."""
    model = leaky_model().double()
    ids, cu_seqlens, probe = _pack()
    logits, loss_sum, grads = [], 0.0, {}
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        doc_logits, doc_loss, doc_grads = _logits_loss_and_gradients(model, ids[:, start:end], None, probe[:, start:end])
        logits.append(doc_logits)
        loss_sum = loss_sum + doc_loss
        for name, grad in doc_grads.items():
            grads[name] = grads[name] + grad if name in grads else grad
    return torch.cat(logits, dim=1), loss_sum, grads


def _packed_errors(model) -> dict[str, float]:
    """Relative error of `model` run on the pack to the float64 model on each document alone: each
    document's logits, the loss, every gradient."""
    ids, cu_seqlens, probe = _pack()
    logits, loss_sum, grads = _logits_loss_and_gradients(model, ids, cu_seqlens, probe)
    expected_logits, expected_loss, expected_grads = _float64_documents_alone()
    errors = {}
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
        errors[f"logits of document {i} ({end - start} tokens)"] = relative_error(
            logits[:, start:end], expected_logits[:, start:end]
        )
    errors["loss"] = relative_error(loss_sum, expected_loss)
    errors.update({f"grad {name}": relative_error(grad, expected_grads[name]) for name, grad in grads.items()})
    return errors


def _assert_packed_matches_documents_alone(model, logits_tolerance, loss_tolerance, grad_tolerance) -> None:
    def tolerance(name):
        return logits_tolerance if name.startswith("logits") else loss_tolerance if name == "loss" else grad_tolerance

    failures = [
        f"{name} off by {error:.2e}, expected <= {tolerance(name):.0e}"
        for name, error in _packed_errors(model).items() if not error <= tolerance(name)
    ]
    assert not failures, "packed run against each document run alone in float64: " + "; ".join(failures)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_packed_documents_match_float64_documents_alone_on_cpu(dtype):
    _assert_packed_matches_documents_alone(leaky_model().to(dtype), *CPU_TOLERANCES[dtype])


def _ignore_cu_seqlens(op):
    def sabotaged(*args, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        return op(*args, **kwargs)  # the pack as one sequence
    return sabotaged


def _zero_one_token_documents(op):
    def sabotaged(*args, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        o, *rest = op(*args, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)
        offsets = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.cpu()).tolist()
        o = o.clone()
        for start, end in zip(offsets[:-1], offsets[1:]):
            if end - start == 1:
                o[:, start] = 0
        return (o, *rest)
    return sabotaged


@pytest.mark.parametrize("sabotage", [_ignore_cu_seqlens, _zero_one_token_documents])
def test_packed_check_fails_an_op_that_mixes_documents_or_drops_one_token_ones(monkeypatch, sabotage):
    import flashqla
    from qwen_hybrid import layers

    monkeypatch.setattr(layers.flashqla, "chunk_gated_delta_rule", sabotage(flashqla.chunk_gated_delta_rule))
    model = leaky_model().float()
    one_token_error = _packed_errors(model)["logits of document 1 (1 tokens)"]
    # far outside bf16's tolerance too, so the GPU test fails such an op as well
    assert one_token_error > 10 * BF16_TOLERANCES[0], (
        f"the sabotaged op moved the one-token document's logits by {one_token_error:.2e}, "
        f"expected > {10 * BF16_TOLERANCES[0]:.0e}"
    )
    with pytest.raises(AssertionError, match=r"logits of document 1 \(1 tokens\) off by"):
        _assert_packed_matches_documents_alone(model, *CPU_TOLERANCES[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["tilelang", "fla"])
def test_gpu_bf16_packed_documents_match_float64_documents_alone(backend):
    """bf16 on the GPU (GDN kernels, varlen FlashAttention, compiled elementwise chains) on a pack
    with a one-token document, against the float64 torch model on each document alone (CPU)."""
    if backend == "fla":
        pytest.importorskip("fla")
    _assert_packed_matches_documents_alone(leaky_model(backend).to("cuda", torch.bfloat16), *BF16_TOLERANCES)


def test_model_reads_cu_seqlens_once_and_hands_host_offsets_to_every_gdn_layer(monkeypatch):
    """The kernels plan from host offsets; the model passes its one host copy down so no layer
    reads cu_seqlens back from the device again."""
    import flashqla
    from qwen_hybrid import layers

    seen = []
    op = flashqla.chunk_gated_delta_rule

    def recording_op(*args, cu_seqlens=None, cu_seqlens_cpu=None, **kwargs):
        seen.append(None if cu_seqlens_cpu is None else (cu_seqlens_cpu.device.type, cu_seqlens_cpu.tolist()))
        return op(*args, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, **kwargs)

    monkeypatch.setattr(layers.flashqla, "chunk_gated_delta_rule", recording_op)
    config = QwenHybridConfig.named("tiny", gdn_backend="torch")
    model = QwenHybridForCausalLM(config)
    ids = torch.randint(0, config.vocab_size, (1, 40))
    model(ids, cu_seqlens=torch.tensor([0, 15, 40], dtype=torch.int32), labels=ids).loss.backward()
    gdn_layers = config.layer_types.count("linear_attention")
    assert seen == [("cpu", [0, 15, 40])] * gdn_layers


@pytest.mark.gpu
@pytest.mark.parametrize("needs", ["both", "hidden_only"])
def test_chunked_cross_entropy_on_cuda_matches_float64(needs):
    """The compiled chunk passes (CUDA, bf16) with the gradients made in the forward, scaled by the
    loss's own gradient in the backward, against float64 autograd of the full cross entropy."""
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(3000, 256, generator=generator).to("cuda", torch.bfloat16)
    weight = (torch.randn(50000, 256, generator=generator) / 8).to("cuda", torch.bfloat16)
    labels = torch.randint(0, 50000, (3000,), generator=generator).cuda()
    labels[::5] = -100
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(needs == "both")
    loss = chunked_cross_entropy(h, w, labels, chunk_size=1024)
    (loss * 3.0).backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected = F.cross_entropy(h64 @ w64.t(), labels, ignore_index=-100)
    (expected * 3.0).backward()
    assert relative_error(loss, expected) <= 1e-3
    assert torch.isfinite(h.grad).all() and relative_error(h.grad, h64.grad) <= 1e-2
    if needs == "both":
        assert torch.isfinite(w.grad).all() and relative_error(w.grad, w64.grad) <= 1e-2
    else:
        assert w.grad is None


def test_set_gdn_backend_reaches_every_gdn_layer_and_names_a_bad_one():
    model = tiny_model()
    model.set_gdn_backend("auto")
    rules = [m for m in model.modules() if isinstance(m, GatedDeltaRule)]
    assert len(rules) == 2 and all(rule.backend == "auto" for rule in rules) and model.config.gdn_backend == "auto"
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'tilelang', 'torch', 'fla'\), got 'triton'"):
        model.set_gdn_backend("triton")
    assert all(rule.backend == "auto" for rule in rules)
