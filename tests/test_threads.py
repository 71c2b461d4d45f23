"""Results do not depend on the thread count: bitwise equal with 1 thread and all threads;
the kernels' task queue hands out every task once."""

import numba
import numpy as np
import pytest

from checks import randn
from sdpa_numba import scaled_dot_product_attention as sdpa
from sdpa_numba.cpu.tasks import next_task, task_queue


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_bitwise_equal_across_thread_counts(rng, dtype, causal):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs at least 2 threads to compare")
    q = randn(rng, (2, 3, 300, 40), dtype)
    k = randn(rng, (2, 3, 270, 40), dtype)
    v = randn(rng, (2, 3, 270, 24), dtype)
    mask = rng.random((300, 270)) < 0.9
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = sdpa(q, k, v, attn_mask=mask, is_causal=causal, return_lse=True)
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        many = sdpa(q, k, v, attn_mask=mask, is_causal=causal, return_lse=True)
    finally:
        numba.set_num_threads(before)
    for a, b in zip(one, many):
        assert a.tobytes() == b.tobytes()


@numba.njit(parallel=True)
def _drain(n_tasks, queue, runs):
    for _ in numba.prange(n_tasks):  # as the kernels use the queue
        t = next_task(queue, n_tasks)
        while t >= 0:
            runs[t] += 1
            t = next_task(queue, n_tasks)


def test_task_queue_runs_every_task_once():
    for n_tasks in (1, 2, 7, 1000):
        queue = task_queue()
        runs = np.zeros(n_tasks, np.int64)
        _drain(n_tasks, queue, runs)
        assert (runs == 1).all()
        # each prange iteration stops at the first number past the end: at most one each
        assert n_tasks <= queue[0] <= 2 * n_tasks
