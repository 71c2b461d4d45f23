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

Exceptions. An exception raised inside a ``prange`` body is lost: Numba's parallel wrapper
sets it as the Python error of the worker thread and leaves the loop of that thread, and the
launching thread returns as if nothing happened (with the thread's remaining iterations not
run). The kernels' own code raises nothing, but a user's ``score_mod``, ``mask_mod`` or
``score_mod_grad`` may. A task that calls one runs under :func:`run_task`, which catches the
exception and records the task in the queue; after the parallel loop, the kernel runs the
recorded task again on the launching thread (:func:`failed_task`), where the exception
propagates to the caller as from any jitted function. Recipes without user functions run
their tasks bare (resolved at compile time): the plain kernels are unchanged.
"""

import numpy as np
from numba import njit
from numba.extending import overload

from ..score.recipe import absent
from ._llvm import fetch_add
from .options import INLINE


@njit(**INLINE)
def task_queue():
    """A fresh queue, at task 0 (and no failed task: see :func:`failed_task`)."""
    return np.zeros(2, np.int64)


def task_runner(task):
    """``run(r, *args)``, a function of jitted code that calls ``task(*args)`` for a task run
    with recipe ``r`` and returns True, or False if ``r`` has user functions and the task
    raised (the exception is caught; the caller records the task with
    :func:`record_failure`, in the ``prange`` body itself: a failure recorded by a function
    called in between was lost in tests). ``task`` is called as a global, not passed as a
    value: a function value would keep the kernel out of Numba's cache."""
    def run(r, *args):
        raise NotImplementedError("a task runner is only callable from jitted code")

    @overload(run)
    def _run(r, *args):
        if all(absent(r, f) for f in ("score_mod", "mask_mod", "score_mod_grad")):
            def bare(r, *args):
                task(*args)
                return True
            return bare

        def caught(r, *args):
            try:
                task(*args)
            except Exception:  # noqa: BLE001 - run again by the launching thread
                return False
            return True
        return caught
    return run


@njit(**INLINE)
def record_failure(queue, t):
    """Record task ``t`` of ``queue`` as one whose user function raised."""
    queue[1] = t + 1


@njit(**INLINE)
def failed_task(queue):
    """A task of ``queue`` whose user function raised in the parallel loop, or -1: the
    kernel runs it again outside the loop, so that the exception reaches the caller."""
    return queue[1] - 1


@njit
def raise_lost():
    """After a failed task ran again without raising (a user function that raises only
    sometimes): the exception itself is lost, but the result is not to be used."""
    raise RuntimeError("a score_mod, mask_mod or score_mod_grad raised an exception in a "
                       "parallel task of sdpa_numba's CPU kernels (and not when that task "
                       "was run again): the output is incomplete")


@njit(**INLINE)
def next_task(queue, n_tasks):
    """The next task number from ``queue``, or -1 once all ``n_tasks`` are taken."""
    t = fetch_add(queue, 1)
    return t if t < n_tasks else -1
