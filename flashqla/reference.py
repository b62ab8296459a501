"""Torch references for the chunked gated delta rule (docs/gdn-math.md §1-§2).

Two implementations of one function, both differentiable by autograd, on any device:

- `recurrent_gated_delta_rule`: the token-by-token recurrence, the ground truth. Run it on
  float64 inputs to check everything else.
- `chunk_gated_delta_rule_torch`: the chunked form of §2 (gate-free inverse, no positive
  exponents), vectorised over chunks with only the chunk-to-chunk state walk sequential.
  Fast enough to train a small model on a CPU.

Inputs follow the public contract (`flashqla.api`): q, k `[B, T, Hqk, K]`, v `[B, T, Hv, V]`,
g, beta `[B, T, Hv]`, states `[N, Hv, K, V]`. Arguments are assumed validated by the caller.
"""
from __future__ import annotations

import torch

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: the in-kernel normalisation of q and k
    (the same definition as HF Qwen3.5's torch path and FLA's kernels)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (for checking); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequences(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(batch row, start, end) for every sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, seq_len) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def _expand_groups(x: torch.Tensor, num_v_heads: int) -> torch.Tensor:
    """Repeat qk heads so that value head h reads qk head h // (Hv // Hqk)."""
    group = num_v_heads // x.shape[2]
    return x if group == 1 else x.repeat_interleave(group, dim=2)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T;  o_t = scale S_t^T q_t."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype, out_dtype = compute_dtype(q.dtype), v.dtype
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.to(dtype)), l2_normalize(k.to(dtype))
    q, k = _expand_groups(q.to(dtype), Hv), _expand_groups(k.to(dtype), Hv)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)

    outputs, finals = [], []
    for i, (b, start, end) in enumerate(_sequences(cu_seqlens, B, T)):
        if initial_state is None:
            state = q.new_zeros(Hv, K, V)
        else:
            state = initial_state[i].to(dtype)
        for t in range(start, end):
            state = state * g[b, t].exp()[:, None, None]
            k_t = k[b, t]  # [Hv, K]
            residual = v[b, t] - torch.einsum("hk,hkv->hv", k_t, state)
            state = state + torch.einsum("hk,hv->hkv", k_t * beta[b, t][:, None], residual)
            outputs.append((b, t, scale * torch.einsum("hk,hkv->hv", q[b, t], state)))
        finals.append(state)

    o = torch.zeros(B, T, Hv, V, dtype=dtype, device=v.device)
    if outputs:
        rows = torch.tensor([b for b, _, _ in outputs], device=v.device)
        cols = torch.tensor([t for _, t, _ in outputs], device=v.device)
        o = o.index_put((rows, cols), torch.stack([x for _, _, x in outputs]))
    final_state = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final_state


def _pad_to_chunks(x: torch.Tensor, spans: list[tuple[int, int, int]], num_chunks: int) -> torch.Tensor:
    """[B, T, ...] -> [N, num_chunks * C, ...], each sequence zero-padded at its end.

    Zero k and beta make the padded tokens exact no-ops for the state (exp(0) = 1, no update)."""
    padded = x.new_zeros(len(spans), num_chunks * CHUNK_SIZE, *x.shape[2:])
    for i, (b, start, end) in enumerate(spans):
        padded[i, : end - start] = x[b, start:end]
    return padded


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked form of docs/gdn-math.md §2, chunk C = 64, in float32 (float64 for float64 input)."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q.to(dtype)), l2_normalize(k.to(dtype))

    spans = _sequences(cu_seqlens, B, T)
    N = len(spans)
    num_chunks = _chunk_count(spans)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return _chunked(x.to(dtype), spans, num_chunks)

    q_c, k_c = chunked(_expand_groups(q, Hv)), chunked(_expand_groups(k, Hv))
    v_c, g_c, beta_c = chunked(v), chunked(g), chunked(beta)

    gamma, a_tilde, a_b, intra = _chunk_matrices(q_c, k_c, g_c, beta_c)
    d = gamma.exp()[..., None]  # D as a column
    e = (gamma[..., -1:] - gamma).exp()[..., None]  # E as a column
    u = a_b @ v_c  # Delta = u - w S0
    w = a_b @ (d * k_c)
    q_decayed = d * q_c
    k_tail = (e * k_c).transpose(-1, -2)  # [.., K, C]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # e^{gamma_C}

    if initial_state is None:
        state = q.new_zeros(N, Hv, K, V, dtype=dtype)
    else:
        state = initial_state.to(dtype)
    outs = []
    for n in range(num_chunks):
        delta = u[:, :, n] - w[:, :, n] @ state
        outs.append(scale * (q_decayed[:, :, n] @ state + intra[:, :, n] @ delta))
        state = chunk_decay[:, :, n] * state + k_tail[:, :, n] @ delta

    o = _unchunked(torch.stack(outs, dim=2), spans, T, cu_seqlens is not None)
    return o.to(v.dtype), (state if output_final_state else None)


def chunk_products(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None = None,
                   cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A~, Ab, P) of docs/gdn-math.md §2.3, the state-independent C x C matrices of every chunk,
    token-major like the kernels store them: [B, T, Hv, C], row t of its chunk's matrix (P with scale).
    Computed as chunk_gated_delta_rule_torch computes them, in its dtype."""
    B, T, _, K = q.shape
    Hv = g.shape[2]
    scale = K ** -0.5 if scale is None else scale
    dtype = compute_dtype(q.dtype)
    spans = _sequences(cu_seqlens, B, T)
    num_chunks = _chunk_count(spans)

    def chunked(x: torch.Tensor) -> torch.Tensor:
        return _chunked(x.to(dtype), spans, num_chunks)

    _, a_tilde, a_b, intra = _chunk_matrices(chunked(_expand_groups(q, Hv)), chunked(_expand_groups(k, Hv)),
                                                chunked(g), chunked(beta))
    return tuple(_unchunked(x, spans, T, cu_seqlens is not None) for x in (a_tilde, a_b, scale * intra))


def _chunk_count(spans: list[tuple[int, int, int]]) -> int:
    longest = max((end - start for _, start, end in spans), default=0)
    return max(1, -(-longest // CHUNK_SIZE))


def _chunked(x: torch.Tensor, spans: list[tuple[int, int, int]], num_chunks: int) -> torch.Tensor:
    """[B, T, H, ...] -> [N, H, num_chunks, C, ...], each sequence zero-padded at its end."""
    x = _pad_to_chunks(x, spans, num_chunks)
    return x.view(len(spans), num_chunks, CHUNK_SIZE, *x.shape[2:]).movedim(3, 1)


def _unchunked(x: torch.Tensor, spans: list[tuple[int, int, int]], seq_len: int, packed: bool) -> torch.Tensor:
    """[N, H, num_chunks, C, D] -> token-major [B, T, H, D] (packed: [1, total, H, D]), padding dropped."""
    N, H, num_chunks = x.shape[:3]
    padded = x.movedim(1, 3).reshape(N, num_chunks * CHUNK_SIZE, H, x.shape[-1])
    if not packed:
        return padded[:, :seq_len]
    return torch.cat([padded[i, : end - start] for i, (_, start, end) in enumerate(spans)])[None]


def _chunk_matrices(q_c, k_c, g_c, beta_c):
    """Everything that does not depend on the state, for all chunks at once ([N, H, n, C, ...] inputs):
    gamma, A~, Ab and the gated scores Gm * tril(Q K^T) (P without the scale)."""
    C = CHUNK_SIZE
    gamma = g_c.cumsum(-1)  # [N, H, n, C], non-increasing within a chunk
    causal = torch.ones(C, C, dtype=torch.bool, device=q_c.device).tril()
    strict = causal.tril(-1)
    # Gm[t, s] = exp(gamma_t - gamma_s) for s <= t; the masked exponent is -inf, never positive.
    decay_diff = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~causal, float("-inf"))
    gm = decay_diff.exp()
    kkt = k_c @ k_c.transpose(-1, -2)
    lower = (beta_c[..., :, None] * kkt).masked_fill(~strict, 0)
    eye = torch.eye(C, dtype=k_c.dtype, device=k_c.device)
    a_tilde = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    a_b = gm * a_tilde * beta_c[..., None, :]  # Ab = (Gm . A~) diag(beta)
    intra = gm * (q_c @ k_c.transpose(-1, -2)).masked_fill(~causal, 0)
    return gamma, a_tilde, a_b, intra
