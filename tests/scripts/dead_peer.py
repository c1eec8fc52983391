"""Rank 1 dies after one good exchange; rank 0's next exchange must fail fast with an error naming
rank 1, instead of hanging. Run under mpirun -n 2 with the launcher told not to kill the survivor."""

import os
import time

import cupy

import mkernel
from mkernel.diagnostics.selftest import Protocol

comm = mkernel.init()
proto = Protocol(comm, 1024)
proto.run("exchange")
cupy.cuda.get_current_stream().synchronize()
comm.check()
comm.mpi.Barrier()
if comm.rank == 1:
    os._exit(9)  # dies without a word
time.sleep(0.5)
t = time.monotonic()
proto.run("exchange")
cupy.cuda.get_current_stream().synchronize()
try:
    comm.check()
except (mkernel.TimeoutError, mkernel.PeerError) as e:
    print(f"survivor detected after {time.monotonic() - t:.2f} s: {e}", flush=True)
    os._exit(0)  # MPI_Finalize with a dead peer would hang: leave at once
print("survivor did not detect the dead peer", flush=True)
os._exit(1)
