"""Target-neutral ``@njit`` code that the CPU kernels compile and the CUDA kernels compile as
device functions: how a score is formed (:mod:`.recipe`), the dropout stream (:mod:`.dropout`)
and number conversions (:mod:`.numbers`)."""
