"""The task queue of the parallel CPU kernels.

A launch's tasks are numbered ``0 .. n_tasks - 1``; each thread takes the next number from a
shared atomic counter until none are left, so a thread that runs slow (a busy neighbour on a
shared machine, where one core often runs 10-30% slower than the other for seconds) takes
fewer tasks instead of holding up the launch, as a static split would. The kernels drive it
from a ``prange(n_tasks)``::

    queue = task_queue()
    for _ in prange(n_tasks):
        t = next_task(queue, n_tasks)
        while t >= 0:
            ...  # run task t
            t = next_task(queue, n_tasks)

Each thread's first iteration of the (static) prange takes tasks until the queue is empty; its
other iterations find it empty. No thread count is read (``numba.get_num_threads`` in a kernel
stops Numba from caching it). Which thread runs a task never changes its arithmetic, so results
do not depend on the thread count.
"""

import numpy as np
from numba import njit

from ._llvm import fetch_add
from .options import INLINE


@njit(**INLINE)
def task_queue():
    """A fresh queue, at task 0."""
    return np.zeros(1, np.int64)


@njit(**INLINE)
def next_task(queue, n_tasks):
    """The next task number from ``queue``, or -1 once all ``n_tasks`` are taken."""
    t = fetch_add(queue, 1)
    return t if t < n_tasks else -1
