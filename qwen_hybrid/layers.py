"""The layers of the hybrid model as plain modules.

Parameter names equal HF `Qwen3_5ForCausalLM`'s so the checkpoint adapter only handles prefixes.
Every block reads its head counts from its projections' outputs at forward time (only the head
dims and the value-heads-per-key-head ratio are attributes), so a model sharded by heads from
outside only has to slice the weights.

Context parallelism hooks in through one declared slot per token mixer, `head_exchange` (None:
the block holds the whole sequence). Set (by `qwen_hybrid.parallel.context`) it is an object with
- `size`, `rank`: the ranks sharing the sequence, and this one's place among them;
- `to_heads(parts)`: parts [B, T/size, n_i, d_i] of this rank's token slice -> [B, T, sum_i
  (n_i/size) * d_i], the whole sequence for head group `rank` of every part, concatenated along
  the last dim in part order;
- `to_tokens(x)`: [B, T, n, d] (this rank's head group) -> [B, T/size, n * size, d] (every head,
  this rank's tokens).
The block then runs its conv, gated delta rule or attention on whole sequences of its head group.

Norms, the conv, RoPE and the decay gates compute in float32, or in float64 for float64 inputs
(the reference checks), like the loss and the gated delta rule's torch path.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import flashqla
from flashqla.conv import causal_conv1d_silu, causal_conv1d_silu_torch, kernel_unavailable_reason
from qwen_hybrid.attention import causal_attention
from qwen_hybrid.config import QwenHybridConfig


def fused(function, checkpointed: bool = False):
    """function as one fused kernel per chain that keeps only its inputs for the backward.

    On CUDA (not float64): torch.compile. Its partitioner saves the chain's inputs (and row
    statistics) and recomputes the rest inside the backward's fused kernel, which keeps what
    `checkpoint` around it would keep without a second forward call in the backward (the saved
    bytes, measured on the CPU at 8192 tokens: docs/performance.md). Where the partitioner keeps
    more (the torch conv chain: 7x its input), `checkpointed=True` puts the compiled call under
    `checkpoint`. Shapes are static at first (a row length known at compile time makes inductor's
    reductions and index arithmetic much cheaper than symbolic ones), and a dim that changes
    between calls turns symbolic on its first change (torch's automatic dynamic shapes), so a run
    compiles each chain once or twice.
    Elsewhere, for float64 (torch 2.11's inductor emits Triton reductions that fail to compile for
    it; float64 runs are reference checks) and with compilation off (torch's own
    TORCH_COMPILE_DISABLE=1): eager under `checkpoint`, since eager autograd would keep every
    float32 intermediate alive, several times the size of the bf16 input."""
    compiled = torch.compile(function)

    def call(*args):
        runs_compiled = args[0].is_cuda and args[0].dtype != torch.float64 and not torch._dynamo.config.disable
        run = compiled if runs_compiled else function
        if torch.is_grad_enabled() and (checkpointed or not runs_compiled):
            return checkpoint(run, *args, use_reentrant=False)
        return run(*args)

    call.__name__ = function.__name__
    return call


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half, bfloat16 and float32 inputs; float64 stays float64 (reference checks: a
    float32 step there would round, and a weight gradient summed in float32 would differ with
    how the tokens are split over ranks)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm in float32 (float64 for float64 x): normalise, scale by (1 + weight), round once."""
    dtype = compute_dtype(x.dtype)
    x_float = x.to(dtype)
    normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.to(dtype))).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = compute_dtype(x.dtype)
    x_float = x.to(dtype)
    normed = (x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # HF rounds to the input dtype before the weight and upcasts again for the gate
    return (weight * normed * F.silu(gate.to(dtype))).to(x.dtype)


_fused_rms_norm = fused(rms_norm)
_fused_gated_rms_norm = fused(gated_rms_norm)


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the weight is stored as an offset from 1 (Qwen3.5's convention)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _fused_rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the GDN output per value head (weight stored as is), then times SiLU(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return _fused_gated_rms_norm(x, gate, self.weight, self.eps)


# compiled, its backward would keep 7x the input (shifted float32 copies): recompute it instead
_fused_conv1d_silu = fused(causal_conv1d_silu_torch, checkpointed=True)


def held_shape(parameter: torch.Tensor) -> torch.Size:
    """The shape of the parameter this rank holds, also where ZeRO-3 has emptied it between its uses
    (it keeps the shape as ds_shape)."""
    return getattr(parameter, "ds_shape", parameter.shape)


def positions_in_documents(length: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """[length] int64: each token's position in its document of `cu_seqlens` (0.. length - 1 without)."""
    positions = torch.arange(length, device=device)
    if cu_seqlens is None:
        return positions
    starts = cu_seqlens.to(device=device, dtype=torch.long)
    return positions - starts[torch.searchsorted(starts[1:], positions, right=True)]


@dataclasses.dataclass(frozen=True)
class DocumentLayout:
    """Where the packed documents of one forward lie, built once at the model boundary and handed
    to every layer, so that no layer reads offsets back from the device or rebuilds positions.
    Under context parallelism it describes the whole sequence, not this rank's slice."""

    cu_seqlens: torch.Tensor  # [N+1] int32 on the model's device
    cu_seqlens_cpu: torch.Tensor  # its host copy: the kernels plan their grids from it
    max_seqlen: int
    position_in_doc: torch.Tensor  # [T] int32 on the device: each token's position in its document

    @classmethod
    def build(cls, cu_seqlens: torch.Tensor, device, cu_seqlens_cpu: torch.Tensor | None = None) -> "DocumentLayout":
        """cu_seqlens on the CPU or `device`; its host copy, when given, spares the one device->host read."""
        if cu_seqlens_cpu is None:
            cu_seqlens_cpu = cu_seqlens.cpu()
        lengths = (cu_seqlens_cpu[1:] - cu_seqlens_cpu[:-1]).tolist()
        on_device = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
        positions = positions_in_documents(int(cu_seqlens_cpu[-1]), on_device, device).to(torch.int32)
        return cls(on_device, cu_seqlens_cpu, max(lengths, default=0), positions)


class CausalConv1d(nn.Module):
    """Depthwise causal conv over time followed by SiLU, restarting at each document.

    Weight `[channels, 1, kernel]` as in HF's `nn.Conv1d(groups=channels)`. backend (the config's
    conv_backend): "tilelang" runs flashqla's Hopper kernel, "torch" the compiled torch chain,
    "auto" the kernel where it runs (flashqla.conv).
    """

    def __init__(self, channels: int, kernel_size: int, backend: str = "auto"):
        super().__init__()
        self.kernel_size = kernel_size
        self.backend = backend
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor, position_in_doc: torch.Tensor | None = None,
                channels: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """x: [B, T, C] -> [B, T, C]. position_in_doc [T]: each token's position in its document
        (None: each row is one). `channels`: the weight rows [start, end) that x's channels are, in
        order (a head group's under context parallelism); default all of them."""
        weight = self.weight
        if channels is not None:
            weight = torch.cat([weight[start:end] for start, end in channels])
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(f"x has {x.shape[-1]} channels but the conv weight rows give {weight.shape[0]}")
        if self.backend == "tilelang" or (self.backend == "auto" and kernel_unavailable_reason(x) is None):
            return causal_conv1d_silu(x, weight, position_in_doc, backend="tilelang")
        return _fused_conv1d_silu(x, weight, position_in_doc)


class GatedDeltaRule(nn.Module):
    """Parameter-free wrapper of `flashqla.chunk_gated_delta_rule` (a hook point for timing)."""

    def __init__(self, backend: str = "auto", keep_for_backward: bool | str = True):
        super().__init__()
        self.backend = backend
        self.keep_for_backward = keep_for_backward

    def forward(self, q, k, v, g, beta, documents: DocumentLayout | None = None) -> torch.Tensor:
        cu_seqlens, cu_seqlens_cpu = (None, None) if documents is None else (documents.cu_seqlens, documents.cu_seqlens_cpu)
        o, _ = flashqla.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
            backend=self.backend, keep_for_backward=self.keep_for_backward,
        )
        return o

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, keep_for_backward={self.keep_for_backward}"


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention block: fused qkv projection -> causal conv + SiLU -> gated delta
    rule (q/k L2-normalised in the op) -> gated RMSNorm with z -> out projection.

    `in_proj_qkv` and `conv1d` channels are laid out [q (all k heads) | k (all k heads) | v (all v heads)].
    Value head h reads key head h // (Hv/Hk), so any contiguous range of key heads with its value
    heads is a self-contained group (what tensor and context parallelism split by).
    """

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float = 1e-6,
        backend: str = "auto",
        conv_backend: str = "auto",
        keep_for_backward: bool | str = True,
    ):
        super().__init__()
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        self.value_heads_per_key_head = num_v_heads // num_k_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.in_proj_qkv = nn.Linear(hidden_size, 2 * key_dim + value_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv1d = CausalConv1d(2 * key_dim + value_dim, conv_kernel_size, conv_backend)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(head_v_dim, eps=eps)
        self.out_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.gated_delta_rule = GatedDeltaRule(backend, keep_for_backward)
        self.head_exchange = None  # context parallelism (module docstring)

    # Head counts this module holds, from its parameter shapes (for inspection: forward reads them
    # from its projections' outputs).
    @property
    def num_v_heads(self) -> int:
        return held_shape(self.A_log)[0]

    @property
    def num_k_heads(self) -> int:
        return self.num_v_heads // self.value_heads_per_key_head

    def forward(self, x: torch.Tensor, documents: DocumentLayout | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        dk, dv = self.head_k_dim, self.head_v_dim
        qkv, b, a = self.in_proj_qkv(x), self.in_proj_b(x), self.in_proj_a(x)
        num_v = b.shape[-1]  # the heads this rank holds (fewer under tensor parallelism)
        num_k = num_v // self.value_heads_per_key_head
        conv_channels, A_log, dt_bias = None, self.A_log, self.dt_bias
        if self.head_exchange is not None:
            qkv, b, a, conv_channels, A_log, dt_bias, num_k, num_v = self._exchange_to_heads(qkv, b, a, num_k, num_v)
        key_dim, value_dim = num_k * dk, num_v * dv
        qkv = self.conv1d(qkv, None if documents is None else documents.position_in_doc, conv_channels)
        q, k, v = torch.split(qkv, [key_dim, key_dim, value_dim], dim=-1)
        mixed_length = qkv.shape[1]  # the whole sequence under context parallelism
        q = q.reshape(batch, mixed_length, num_k, dk)
        k = k.reshape(batch, mixed_length, num_k, dk)
        v = v.reshape(batch, mixed_length, num_v, dv)
        beta = torch.sigmoid(b)
        # float32 so that exp(A_log) cannot overflow in half precision
        dtype = compute_dtype(x.dtype)
        g = -A_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))
        o = self.gated_delta_rule(q, k, v, g, beta, documents)
        if self.head_exchange is not None:
            o = self.head_exchange.to_tokens(o)
        z = self.in_proj_z(x).reshape(batch, length, -1, dv)
        o = self.norm(o, z).reshape(batch, length, -1)
        return self.out_proj(o)

    def _exchange_to_heads(self, qkv, b, a, num_k, num_v):
        """This rank's token slice of every head -> the whole sequence of its head group, with the
        conv rows, A_log and dt_bias of that group."""
        exchange, dk, dv = self.head_exchange, self.head_k_dim, self.head_v_dim
        batch, length = qkv.shape[:2]
        q, k, v = torch.split(qkv, [num_k * dk, num_k * dk, num_v * dv], dim=-1)
        packed = exchange.to_heads([
            q.reshape(batch, length, num_k, dk), k.reshape(batch, length, num_k, dk),
            v.reshape(batch, length, num_v, dv), b.unsqueeze(-1), a.unsqueeze(-1),
        ])
        k_here, v_here = num_k // exchange.size, num_v // exchange.size
        first_k, first_v = exchange.rank * k_here, exchange.rank * v_here
        key_dim = num_k * dk
        conv_channels = [
            (first_k * dk, (first_k + k_here) * dk),
            (key_dim + first_k * dk, key_dim + (first_k + k_here) * dk),
            (2 * key_dim + first_v * dv, 2 * key_dim + (first_v + v_here) * dv),
        ]
        qkv, b, a = torch.split(packed, [2 * k_here * dk + v_here * dv, v_here, v_here], dim=-1)
        heads = slice(first_v, first_v + v_here)
        return qkv, b, a, conv_channels, self.A_log[heads], self.dt_bias[heads], k_here, v_here


class AttentionCore(nn.Module):
    """Parameter-free causal softmax attention with GQA and per-document masking (a hook point for
    timing): q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H, D]. `backend` is the config's
    attention_backend; qwen_hybrid.attention picks the kernel per call."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = backend

    def forward(self, q, k, v, documents: DocumentLayout | None = None) -> torch.Tensor:
        return causal_attention(q, k, v, documents, self.backend)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, T, H, D] (rotate-half layout)."""
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim].to(compute_dtype(x.dtype)), x[..., rotary_dim:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    half = rotary_dim // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    return torch.cat([(x_rot * cos + rotated * sin).to(x.dtype), x_pass], dim=-1)


def _norm_rotary(x, norm_weight, cos, sin, eps) -> torch.Tensor:
    return apply_rotary(rms_norm(x, norm_weight, eps), cos, sin)


_fused_norm_rotary = fused(_norm_rotary)


class GatedAttention(nn.Module):
    """Qwen3.5's full-attention block: q projection carries a per-head output gate, zero-centred
    RMSNorm on q and k per head, partial RoPE, grouped KV heads, causal attention, sigmoid gate."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float = 1e-6,
                 attention_backend: str = "auto"):
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = head_dim
        # per head: [query (head_dim) | gate (head_dim)]
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=eps)
        self.k_norm = RMSNorm(head_dim, eps=eps)
        self.attention = AttentionCore(attention_backend)
        self.head_exchange = None  # context parallelism (module docstring)
        # set by set_activation_checkpointing(recompute_attention=False): recompute the projections
        # and the output in the backward but keep the attention kernel's inputs and outputs
        self.checkpoint_around_attention = False

    # Head counts this module holds, from its parameter shapes (as in GatedDeltaNet; the training
    # loop's memory estimate reads them).
    @property
    def num_heads(self) -> int:
        return held_shape(self.o_proj.weight)[1] // self.head_dim

    @property
    def num_kv_heads(self) -> int:
        return held_shape(self.k_proj.weight)[0] // self.head_dim

    def forward(self, x, cos, sin, documents: DocumentLayout | None = None) -> torch.Tensor:
        """x [B, T, hidden]; cos, sin [B, T, rotary_dim] for x's tokens (a slice's under context
        parallelism, while `documents` describes the whole sequence)."""
        if self.checkpoint_around_attention and torch.is_grad_enabled():
            q, k, v, gate = checkpoint(self._attention_inputs, x, cos, sin, use_reentrant=False)
            out = self.attention(q, k, v, documents)
            return checkpoint(self._attention_output, out, gate, use_reentrant=False)
        q, k, v, gate = self._attention_inputs(x, cos, sin)
        return self._attention_output(self.attention(q, k, v, documents), gate)

    def _attention_inputs(self, x, cos, sin):
        """q, k, v as the attention kernel takes them (normed, rotated; a head group's whole sequence
        under context parallelism) and the output gate [B, T, H, d] of x's tokens."""
        batch, length, _ = x.shape
        # head counts come from the projections: fewer than the config's under tensor parallelism
        query, gate = self.q_proj(x).view(batch, length, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = _fused_norm_rotary(query, self.q_norm.weight, cos, sin, self.q_norm.eps)
        k = self.k_proj(x).view(batch, length, -1, self.head_dim)
        k = _fused_norm_rotary(k, self.k_norm.weight, cos, sin, self.k_norm.eps)
        v = self.v_proj(x).view(batch, length, -1, self.head_dim)
        if self.head_exchange is not None:
            q, k, v = self._exchange_to_heads(q, k, v)
        return q, k, v, gate

    def _attention_output(self, out, gate):
        if self.head_exchange is not None:
            out = self.head_exchange.to_tokens(out)
        batch, length = gate.shape[:2]
        out = out.reshape(batch, length, -1) * torch.sigmoid(gate.reshape(batch, length, -1))
        return self.o_proj(out)

    def _exchange_to_heads(self, q, k, v):
        """Ulysses: this rank's tokens of every head -> the whole sequence of its query heads and
        the KV heads they read. KV heads fewer than the ranks are repeated first (as tensor
        parallelism replicates them), so each rank receives the one its query heads read."""
        exchange, head_dim = self.head_exchange, self.head_dim
        if k.shape[2] < exchange.size:
            copies = exchange.size // k.shape[2]
            k, v = k.repeat_interleave(copies, dim=2), v.repeat_interleave(copies, dim=2)
        heads_here, kv_here = q.shape[2] // exchange.size, k.shape[2] // exchange.size
        packed = exchange.to_heads([q, k, v])
        batch, length = packed.shape[:2]
        q, k, v = torch.split(packed, [heads_here * head_dim, kv_here * head_dim, kv_here * head_dim], dim=-1)
        # contiguous, as the projections' outputs are: the attention kernels get the layout they always get
        return (q.reshape(batch, length, heads_here, head_dim).contiguous(),
                k.reshape(batch, length, kv_here, head_dim).contiguous(),
                v.reshape(batch, length, kv_here, head_dim).contiguous())


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(_fused_swiglu(self.gate_proj(x), self.up_proj(x)))


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_fused_swiglu = fused(_swiglu)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN `linear_attn` or attention `self_attn`), then MLP."""

    def __init__(self, config: QwenHybridConfig, layer_index: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                eps=config.rms_norm_eps, backend=config.gdn_backend, conv_backend=config.conv_backend,
                keep_for_backward=config.gdn_keep_for_backward,
            )
        else:
            self.self_attn = GatedAttention(
                config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                eps=config.rms_norm_eps, attention_backend=config.attention_backend,
            )
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # recomputed in the backward (QwenHybridForCausalLM.set_activation_checkpointing)
        self.checkpointed = False

    def forward(self, hidden, cos, sin, documents: DocumentLayout | None = None) -> torch.Tensor:
        mixer_input = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            hidden = hidden + self.linear_attn(mixer_input, documents)
        else:
            hidden = hidden + self.self_attn(mixer_input, cos, sin, documents)
        if self.checkpoints_itself and torch.is_grad_enabled():
            return hidden + checkpoint(self._mlp_block, hidden, use_reentrant=False)
        return hidden + self._mlp_block(hidden)

    @property
    def checkpoints_itself(self) -> bool:
        """An attention layer that keeps its attention kernel's tensors checkpoints its parts itself:
        checkpointing the layer as a whole would recompute the attention too."""
        return self.layer_type == "full_attention" and self.self_attn.checkpoint_around_attention

    def _mlp_block(self, hidden):
        return self.mlp(self.post_attention_layernorm(hidden))
