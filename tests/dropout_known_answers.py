"""Known answers of the dropout stream, pinned for the CPU and the CUDA suites.

Computed once from the implementation at the commit that added them (checked against the
plain-Python SplitMix64 of tests/test_dropout.py::test_hash_matches_splitmix64). Unlike the
NumPy reference, they do not import the kernels' constants: a constant changed in both the
kernels and sdpa_numba.dropout keeps those two equal, but fails against these.
"""

import numpy as np

KNOWN_HASHES = {  # (seed, b, h, i, j) -> the uint64 bits of key j of that row
    (0, 0, 0, 0, 0): 0x2130748AAAC80268,
    (42, 1, 2, 3, 4): 0x723586F36DE6B5EA,
    (2**63 + 12345, 3, 1, 70, 129): 0x7BABC37C9958E467,
    (2**64 - 1, 0, 5, 511, 1000): 0xC808ED1A7276E9E2,
}
#: keep_mask(1234, 0.5, (2,), 2, 3, 70)[b, h, i] as an int, bit j = key j kept.
KNOWN_KEEP_1234 = {
    (0, 0, 0): 0x382FED39B72FC65B2, (0, 0, 1): 0x306CF292D448ED4C88,
    (0, 0, 2): 0x35308EDBC8C33B3665, (0, 1, 0): 0x3A99FB2F76FAE28EB,
    (0, 1, 1): 0x2382C939C4EC29794D, (0, 1, 2): 0x231B8B982DE904C272,
    (1, 0, 0): 0x2F6D98260F83806FD9, (1, 0, 1): 0x12899CB4F4F3129ECC,
    (1, 0, 2): 0x23638CD517820360A, (1, 1, 0): 0x16BE089D07D58CADBB,
    (1, 1, 1): 0x2B3C7171D69445F5FC, (1, 1, 2): 0x163FCC40E53AFC3420,
}


def known_keep_1234():
    """The known keep mask, (2, 2, 3, 70) bool."""
    keep = np.zeros((2, 2, 3, 70), bool)
    for (b, h, i), bits in KNOWN_KEEP_1234.items():
        keep[b, h, i] = [(bits >> j) & 1 for j in range(70)]
    return keep
