"""Helpers for mkernel's tests and benchmarks (as ``cupy.testing`` is for CuPy's)."""

import os
import time


def sync_or_exit(what: str, timeout_s: float = 30.0, stream=None) -> None:
    """Wait for the work queued so far on ``stream`` (default: the current one); if it has not
    finished after ``timeout_s``, print a HANG line naming ``what`` and end the process at once (a
    hung kernel cannot be interrupted, and under mpirun this ends the job instead of stalling it)."""
    import cupy

    ev = cupy.cuda.Event()
    ev.record(stream)
    t0 = time.time()
    while not ev.done:
        if time.time() - t0 > timeout_s:
            print(f"\nHANG: {what} did not finish in {timeout_s} s; exiting", flush=True)
            os._exit(3)
        time.sleep(0.0005)
