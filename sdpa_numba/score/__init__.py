"""Target-neutral ``@njit`` code that the CPU kernels compile and the CUDA kernels compile as
device functions: today the dropout stream (:mod:`.dropout`)."""
