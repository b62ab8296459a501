"""TileLang kernels for the chunked gated delta rule on Hopper (SM90), K = V = 128.

The math they implement is docs/gdn-math.md. Entries (called with checked inputs):

- forward.py: `forward`, the forward's kernels in order (and `KeptForward`, what it can keep);
- backward.py: `backward`, the backward's kernels in order;
- autograd.py: the two joined for autograd, the "tilelang" backend of flashqla/backends.py.

One file per kernel, in pipeline order:

- inverse.py: the gate-free inverse A~ and gamma (the chunk-local cumsum of g) of every chunk and value head;
- walk_bounds.py: where each piece of a split sequence starts its warm-up (forward) or ends it
  (backward), per head;
- fused_forward.py: the forward's sequential walk, which builds Ab and P on chip from A~: o, the final
  state and, for the backward, the chunk states;
- chunk_states.py: the state-only walk (chunk states and K x K transitions; the tests' independent check of
  the states the fused walk stores, and what a cross-GPU split of the op would exchange);
- backward_fused.py: the backward's reverse walk: the state gradient on chip, dq, dk, dv, dg, dbeta of every
  chunk and dh0;
- l2norm.py: the q/k L2 norm's backward where the walk does not apply it, summing each head group as it reads.

Beside the op: causal_conv.py, the GDN layer's short causal conv + SiLU (flashqla/conv.py's kernel).

Shared: common.py (target, head dim, chunk size, constants), chunk_plan.py (host-side planning:
chunk index, pieces of split sequences, V split; the torch definition of the warm-up bounds), compile_check.py (every kernel
built for sm_90a, no GPU needed).
"""
