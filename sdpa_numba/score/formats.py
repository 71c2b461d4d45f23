"""The 8-bit key/value cache formats' codes and bounds: one definition for the host rules
(:mod:`sdpa_numba.problem.quant`), the user functions (:mod:`sdpa_numba.quant`) and both
targets' kernels (:mod:`sdpa_numba.cpu.quant`, :mod:`sdpa_numba.gpu.quant`).

The kernels take the format as a run-time code: ``FMT_INT8`` (int8 values with scales per
token and head, or per block of 32 values: q8_0), ``FMT_E4M3`` (fp8 ``float8_e4m3fn`` bits)
and ``FMT_E5M2`` (fp8 ``float8_e5m2`` bits).
"""

FMT_INT8 = 0
FMT_E4M3 = 1
FMT_E5M2 = 2

#: Saturation bound (the largest finite value) of each format, and absmax / MAX is the scale.
INT8_MAX = 127.0
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
