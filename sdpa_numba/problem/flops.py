"""The FLOP count behind every rate (GFLOP/s) of the benchmarks, the CLI and the docs."""


def flops(B, H, L, S, E, causal=False, backward=False):
    """Floating-point operations of attention over ``B`` x ``H`` heads of ``L`` queries and
    ``S`` keys of head dim ``E``, an int: 4·B·H·L·S·E for the forward (the L x S x E products
    Q Kᵀ and P V, a multiply-add counted as 2); 8·B·H·L·S·E for the backward (the four
    products dV, dP, dQ, dK; recomputing the scores is not counted); half when causal."""
    f = (8 if backward else 4) * B * H * L * S * E
    return f // 2 if causal else f
