"""CPU, float64: the arrangement the state-gradient walk by roles computes (state_grads_roles.py's docstring), with
its whole 64-row tiles read past a sequence's end, gives the gradient of h0 that autograd gives through the
reference. The kernel's own run is test_hopper_state_grads_roles.py's (GPU)."""
import torch

from flashqla import reference

C = 64
SCALE = 128 ** -0.5


def tile(x: torch.Tensor, start: int) -> torch.Tensor:
    """Rows start .. start + C of a packed [T, ...] tensor, zeros past its end (what TMA loads)."""
    rows = x[start:start + C]
    return torch.cat([rows, rows.new_zeros(C - rows.shape[0], *rows.shape[1:])]) if rows.shape[0] < C else rows


def roles_walk_dh0(q, k, do, gamma, ab, pm, dht, bounds):
    """dh0 [N, H, K, V] by the roles' formulas. q, k, do: [T, H, 128]; gamma, the chunk-local cumsum: [T, H];
    ab, pm (Ab, P with the scale): [T, H, C]; dht [N, H, K, V]."""
    dh0 = torch.empty_like(dht)
    for n, (bos, eos) in enumerate(zip(bounds, bounds[1:])):
        ds = dht[n].clone()
        for start in reversed(range(bos, eos, C)):
            last = min(eos - start, C) - 1
            rows = torch.arange(C)
            valid = (rows <= last).to(q.dtype)[:, None]  # [C, 1]
            gam = gamma[start + rows.clamp(max=last)]  # [C, H]
            e_rows = valid * (gam[-1] - gam).exp()  # E
            ek = (e_rows[..., None] * tile(k, start)).movedim(1, 0)  # [H, C, K]
            m = (tile(ab, start) * -gam.exp().T[None]).movedim(1, 0)  # M = Ab diag(-e^gamma), [H, C, C]
            do_t = tile(do, start)
            dog = (valid * SCALE * gam.exp())[..., None] * do_t
            dom = (valid[..., None] * do_t).movedim(1, 0)
            d_delta = tile(pm, start).movedim(1, 0).transpose(-1, -2) @ dom + ek @ ds
            du = m.transpose(-1, -2) @ d_delta
            q_t, k_t = tile(q, start).movedim(1, 0), tile(k, start).movedim(1, 0)
            ds = gam[-1].exp()[:, None, None] * ds + q_t.transpose(-1, -2) @ dog.movedim(1, 0) \
                + k_t.transpose(-1, -2) @ du
        dh0[n] = ds
    return dh0


def test_roles_arrangement_gives_the_float64_gradient_of_h0():
    torch.manual_seed(0)
    lengths, heads = [1, 0, 63, 64, 65, 200], 2
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total = bounds[-1]
    cu = torch.tensor(bounds, dtype=torch.int32)
    q, k = (torch.nn.functional.normalize(torch.randn(1, total, heads, 128, dtype=torch.float64), dim=-1)
            for _ in range(2))
    v = torch.randn(1, total, heads, 128, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(torch.randn(1, total, heads, dtype=torch.float64)) / 4
    g[..., 0] = 0.0  # a head that never decays
    beta = torch.rand(1, total, heads, dtype=torch.float64)
    h0 = torch.randn(len(lengths), heads, 128, 128, dtype=torch.float64, requires_grad=True)
    do, dht = torch.randn_like(v), torch.randn_like(h0)
    o, final = reference.chunk_gated_delta_rule_torch(q, k, v, g, beta, scale=SCALE, initial_state=h0,
                                                      output_final_state=True, cu_seqlens=cu)
    (expected,) = torch.autograd.grad((o * do).sum() + (final * dht).sum(), [h0])

    gamma = torch.cat([g[0, a:b].cumsum(0) if b > a else g[0, a:b]
                       for start, end in zip(bounds, bounds[1:]) for a, b in
                       ((c, min(c + C, end)) for c in range(start, end, C))])
    _, ab, pm = (x[0] for x in reference.chunk_products(q, k, g, beta, SCALE, cu_seqlens=cu))
    mine = roles_walk_dh0(q[0], k[0], do[0], gamma, ab, pm, dht, bounds)
    assert (mine - expected).norm() <= 1e-10 * expected.norm()
