"""Helpers for mkernel's tests and benchmarks (as ``cupy.testing`` is for CuPy's)."""

import os
import time

from mkernel.runtime import gpu


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


class StreamHold:
    """Holds a stream: a kernel spins until :meth:`release` (or ``timeout_s``), so that work queued
    behind it cannot start. Tests use it to show that calls only launch and return. With ``ctas``
    blocks of ``smem`` bytes of shared memory each (one per SM when large), it also holds that many
    SMs, waiting until every block runs: what is left is all another stream's kernels get (a
    persistent kernel then runs with part of its grid resident, as beside a peer's under MPS)."""

    def __init__(self, stream=None, timeout_s: float = 60.0, ctas: int = 1, smem: int = 0):
        import ctypes

        import cupy
        import numpy as np

        words = 1 + ctas  # go, then each block's arrival
        self._ptr = cupy.cuda.runtime.hostAlloc(4 * words, 2)  # mapped: the kernel polls it across PCIe
        self._words = (ctypes.c_uint32 * words).from_address(self._ptr)
        ctypes.memset(self._ptr, 0, 4 * words)
        kernel = cupy.RawKernel(r"""
extern "C" __global__ void mk_test_hold(volatile unsigned int* w, unsigned long long ns) {
  unsigned long long t0, t;
  if (threadIdx.x) return;
  w[1 + blockIdx.x] = 1;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (w[0] == 0 && t - t0 < ns);
}""", "mk_test_hold")
        if smem > 48 * 1024:
            kernel.max_dynamic_shared_size_bytes = smem
        with stream if stream is not None else cupy.cuda.get_current_stream():
            kernel((ctas,), (32,), (self._ptr, np.uint64(int(timeout_s * 1e9))), shared_mem=smem)
            self.started = cupy.cuda.Event()
            self.started.record()
        t0 = time.time()
        while ctas > 1 and sum(self._words[1:]) < ctas:
            if time.time() - t0 > 10:
                self.close()
                raise RuntimeError(f"StreamHold: {sum(self._words[1:])} of {ctas} blocks became resident in 10 s")
            time.sleep(0.001)

    def release(self):
        self._words[0] = 1

    def close(self):
        import cupy

        if self._ptr:
            self.release()
            cupy.cuda.runtime.deviceSynchronize()
            cupy.cuda.runtime.freeHost(self._ptr)
            self._ptr = 0


def mpi_child_env(n: int, env: dict = None) -> tuple:
    """(environment, extra mpirun arguments) for a child job of ``n`` ranks on this machine's GPUs.
    Under MPS each rank gets its share of a GPU's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): clients
    that each count on all of them cannot run their persistent kernels at once."""
    env = dict(os.environ if env is None else env)
    if not gpu.mps_client():
        return env, []
    gpus = max(1, gpu.device_count())
    env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, min(100, 100 * gpus // n)))
    return env, ["-x", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] + (
        ["-x", "CUDA_MPS_PIPE_DIRECTORY"] if "CUDA_MPS_PIPE_DIRECTORY" in env else [])


def bytes_sent(comm) -> int:
    """Bytes this rank's proxy has sent (0 before the first plan between nodes starts it)."""
    return sum(p["bytes_sent"] for p in comm.stats().get("peers", {}).values())


def bytes_sent_since(comm, before: int, want: int, settle_s: float = 5.0) -> int:
    """Bytes sent since ``before``, read once they reached ``want`` or ``settle_s`` passed: a
    sender's kernel may end before its proxy counted its last write (the receiver waits for the
    data, not for the count)."""
    deadline = time.monotonic() + settle_s
    while bytes_sent(comm) - before < want and time.monotonic() < deadline:
        time.sleep(1e-3)
    return bytes_sent(comm) - before
