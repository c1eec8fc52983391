"""Timing ranks that run at once (several ranks on one GPU under CUDA MPS; issue 25's rule).

- A device-side barrier across the ranks starts each timed batch (``DeviceBarrier``: a fused
  all-reduce of one tile, which no rank finishes before every rank started it).
- Each figure is one CUDA-event pair over a batch of ``BATCH`` back-to-back calls, divided by the
  count; the median of ``BATCHES`` batches; the slowest rank's.
- Every "alone" figure (a GEMM, a copy rate) is measured with all ranks doing that same work at
  once: they share HBM, power and the PCIe link.
"""

import statistics

BATCH, BATCHES, WARMUP = 50, 3, 3


class DeviceBarrier:
    """barrier(): queued on the current stream; the work queued behind it starts on every rank
    within about one kernel's latency of the others (between nodes through the proxy)."""

    def __init__(self, comm):
        import cupy

        import harness

        harness.load_spin()  # benches spin right behind the barrier, which waits on the proxy between nodes
        self.comm = comm
        self.a = cupy.zeros((128 * comm.size, 64), cupy.float16)
        self.b = cupy.zeros((64, 256), cupy.float16)
        self.out = cupy.empty((128 * comm.size, 256), cupy.float16)

    def __call__(self):
        import mkernel

        mkernel.gemm_allreduce(self.a, self.b, comm=self.comm, out=self.out, path="fused")


def batch_ms(comm, barrier, fn, n=BATCH, batches=BATCHES, warmup=WARMUP):
    """Milliseconds of one fn() call: the median over batches of (event pair around n back-to-back
    calls started by the device barrier) / n, the slowest rank's (a host collective: benchmarks only)."""
    for _ in range(warmup):
        fn()
    return statistics.median(batch_times(comm, barrier, fn, n=n, batches=batches))


def interleaved_ms(comm, barrier, arms, rounds=4, n=BATCH, warmup=WARMUP):
    """{name: milliseconds of one call} of each arm (name, fn, config overrides) for an A/B: every
    round times one batch of each arm, in reverse order every other round, so drift over the run
    (clocks, a split search settling, the order itself) falls on every arm alike; the median over
    rounds, the slowest rank's. Each arm is warmed up first, under its overrides."""
    import mkernel

    for _, fn, over in arms:
        with mkernel.config.override(**over):
            for _ in range(warmup):
                fn()
    times = {name: [] for name, _, _ in arms}
    for r in range(rounds):
        for name, fn, over in (arms if r % 2 == 0 else arms[::-1]):
            with mkernel.config.override(**over):
                times[name] += batch_times(comm, barrier, fn, n=n, batches=1)
    return {name: statistics.median(ts) for name, ts in times.items()}


def batch_times(comm, barrier, fn, n=BATCH, batches=BATCHES):
    """Per batch, the milliseconds of one fn() call (event pair around n back-to-back calls started
    by the device barrier, / n), each the slowest rank's; no warm-up."""
    import cupy

    times = []
    for _ in range(batches):
        barrier()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(n):
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) / n)
    comm.check()
    return comm.mpi.allreduce(times, op=_elementwise_max)


def synced_ms(comm, barrier, fn, reps=30):
    """Milliseconds of one fn() on each rank's stream right after a device barrier (every rank
    starting it at once, as in a collective op that synchronises every call), the median; the
    slowest rank's. fn None: only the barrier (the ranks that pass a function run it alone)."""
    import cupy
    from mpi4py import MPI

    times = []
    for _ in range(reps):
        barrier()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        if fn is not None:
            fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    comm.check()
    return comm.mpi.allreduce(statistics.median(times), op=MPI.MAX)


def graph_batch_ms(comm, barrier, fn, n=BATCH, batches=BATCHES):
    """batch_ms of fn() with n calls captured once in a CUDA graph (on a stream of its own) and the
    graph replayed per batch: the device's time per call without the host's launch work. Raises
    what the capture raised (an op that allocates or synchronises inside a call cannot be captured)."""
    import cupy
    from mpi4py import MPI

    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        fn()  # a shape's first call (agreement, plans) stays out of the capture
        s.synchronize()
        error, graph = None, None
        try:  # nothing runs while capturing, so a rank whose capture failed diverges from no one
            s.begin_capture()
            try:
                for _ in range(n):
                    fn()
            finally:
                graph = s.end_capture()
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
        if not comm.mpi.allreduce(error is None, op=MPI.LAND):
            raise RuntimeError(f"CUDA graph capture failed: {error or 'on another rank'}")
        graph.launch(s)  # warm-up replay
        times = []
        for _ in range(batches):
            barrier()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(s)
            graph.launch(s)
            stop.record(s)
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / n)
    comm.check()
    return comm.mpi.allreduce(statistics.median(times), op=MPI.MAX)


def print_by_rank(comm, text, what="results"):
    """Rank 0 prints every rank's ``text``, in rank order (collective; bounded wait)."""
    from mkernel.comm.collectives import allgather_object

    rows = allgather_object(comm.mpi, text, what, 60)
    if comm.rank == 0:
        print("\n".join(rows), flush=True)


def _elementwise_max(a, b, _datatype=None):
    return [max(x, y) for x, y in zip(a, b)]


def host_link_gbs(comm, barrier, nbytes=256 << 20):
    """GB/s per rank per direction across PCIe while every rank copies device-to-host and
    host-to-device at once (pinned memory; the two directions on two streams): what one rank's
    bytes to another node can cross per direction."""
    import cupy

    rt = cupy.cuda.runtime
    dev_a, dev_b = cupy.empty(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    host_a, host_b = rt.hostAlloc(nbytes, 0), rt.hostAlloc(nbytes, 0)
    s1, s2 = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    main = cupy.cuda.get_current_stream()

    def both():  # both directions at once, joined on the current stream
        ev = cupy.cuda.Event()
        ev.record(main)
        for s in (s1, s2):
            s.wait_event(ev)
        rt.memcpyAsync(host_a, dev_a.data.ptr, nbytes, 2, s1.ptr)  # device to host
        rt.memcpyAsync(dev_b.data.ptr, host_b, nbytes, 1, s2.ptr)  # host to device
        for s in (s1, s2):
            done = cupy.cuda.Event()
            done.record(s)
            main.wait_event(done)

    try:
        ms = batch_ms(comm, barrier, both, n=5)
    finally:
        rt.freeHost(host_a)
        rt.freeHost(host_b)
    return nbytes / (ms * 1e-3) / 1e9


def device_link_gbs(comm, barrier, nbytes=256 << 20):
    """GB/s of a device-to-device copy while every rank copies at once: inside a node under MPS a
    rank's "NVLink" to a peer is this same memory (a push reads once and writes once, like a copy)."""
    import cupy

    src, dst = cupy.ones(nbytes, cupy.uint8), cupy.empty(nbytes, cupy.uint8)
    ms = batch_ms(comm, barrier, lambda: cupy.copyto(dst, src), n=10)
    return nbytes / (ms * 1e-3) / 1e9


def sms_per_rank():
    from mkernel.runtime.launch import device_sms

    return device_sms()


def full_share_change(comm, op):
    """The config change that times the other grid size (config.mps_full_share) beside the default:
    7/8 of the share where the default takes it whole (launch.full_share), else the whole share."""
    from mkernel.runtime import launch

    return {"mps_full_share": False if launch.full_share(comm, op) else "always"}
