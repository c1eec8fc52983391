"""Every ``MKERNEL_*`` environment variable, in one place.

``docs/ENVIRONMENT.md`` is generated from this table (``python -m mkernel env --markdown``) and a
CPU test checks that the two agree and that no other ``MKERNEL_`` name appears in the sources.
"""

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    doc: str

    def raw(self) -> str:
        return os.environ.get(self.name, self.default)


_DEFAULT_CACHE = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mkernel")

VARS = {
    v.name: v
    for v in [
        Var("MKERNEL_CACHE_DIR", _DEFAULT_CACHE,
            "Directory of the compiled-kernel cache (cubins keyed by the hash of every source and "
            "header, the options, mkernel's and NVRTC's versions). Safe to share between ranks and "
            "to copy to another machine with the same NVRTC version."),
        Var("MKERNEL_NVRTC", "",
            "Path of libnvrtc.so to use instead of searching (the nvidia-cuda-nvrtc wheel, CuPy's "
            "CUDA, CUDA_PATH, the system library path)."),
        Var("MKERNEL_LOG_LEVEL", "INFO",
            "Level of the 'mkernel' logger (DEBUG, INFO, WARNING, ERROR). Log lines carry the rank."),
        Var("MKERNEL_GPUS_PER_NODE", "",
            "Ranks per node, overriding MPI's shared-memory split, so that one host acts as several "
            "nodes (inter-node traffic then goes through the proxy and its transport)."),
        Var("MKERNEL_TRANSPORT", "auto",
            "Inter-node transport: auto, verbs, host, tcp. 'auto' picks verbs when an active RDMA port "
            "exists, else host memory between ranks of one host, else TCP."),
        Var("MKERNEL_TIMEOUT_S", "30",
            "Seconds any device spin-wait or proxy wait may last before it records a timeout that "
            "the host raises as mkernel.TimeoutError (naming op, rank and peer)."),
        Var("MKERNEL_WORKSPACE_BYTES", "auto",
            "Initial size of the symmetric workspace of every rank (it grows in place as ops need). "
            "auto: 1/64 of the GPU's memory divided among the ranks sharing it, 64 MiB to 1 GiB."),
        Var("MKERNEL_WORKSPACE_MAX_BYTES", "0",
            "Most the symmetric workspace may grow to when an op or comm.empty() finds no room (it grows "
            "in place, at a shape's first call, collectively). 0: the device's memory."),
        Var("MKERNEL_WORKSPACE_SHARING", "auto",
            "How the node's ranks map each other's workspace: 'auto' (cuMem allocations shared as file "
            "descriptors, which outlive a rank that dies; legacy CUDA IPC where the driver cannot) or "
            "'ipc' (legacy CUDA IPC: a dead rank's workspace is freed under its peers' kernels)."),
        Var("MKERNEL_TCP_CONNECTIONS", "4",
            "TCP transport: connections per peer (1 to 16); frames of one peer are spread over them."),
        Var("MKERNEL_HOST_RUN_CHUNKS", "4",
            "Host transport: 1 MiB chunks per copy (1 to 16). Longer runs mean fewer, bigger copies; "
            "shorter ones a shorter tail (the last run is copied out alone)."),
        Var("MKERNEL_TCP_ADDR", "",
            "Address the TCP listener binds to. Unset: loopback when every rank is on one host, else the "
            "interface that routes to rank 0's host. It never binds to all interfaces."),
        Var("MKERNEL_VERBS_DEVICE", "",
            "RDMA device name (as in ibv_devices). Unset: the first device with an active port."),
        Var("MKERNEL_VERBS_PORT", "1", "RDMA port number on that device."),
        Var("MKERNEL_VERBS_GID_INDEX", "-1",
            "RoCE GID index; -1 picks RoCE v2 over IPv4 where the port has one (what a routed network carries), "
            "else RoCE v2, else IPv4, else the first GID that is set (InfiniBand: the first that is set)."),
        Var("MKERNEL_BUILD_VERBS", "auto",
            "Build time: 0 builds the proxy extension without the verbs transport even where the "
            "rdma-core headers exist; auto builds it when they exist."),
        Var("MKERNEL_SPLIT_PERSIST", "0",
            "1: comm_sms='auto' keeps the splits its searches converged to in MKERNEL_CACHE_DIR/split/"
            "splits.json (rank 0 writes; every rank starts a key from rank 0's saved state), so a new "
            "process starts a known key at its split. 0: in memory only."),
        Var("MKERNEL_TRACE", "",
            "When set to a path, fused kernels record per-block spans that are written there as "
            "Chrome trace JSON (one track per SM). Free when unset."),
    ]
}


def get(name: str) -> str:
    return VARS[name].raw()


def get_float(name: str) -> float:
    return float(get(name))


def get_int(name: str) -> int:
    return int(get(name))


def markdown() -> str:
    rows = ["# Environment variables", "",
            "Generated from `mkernel/core/env.py` by `python -m mkernel env --markdown`; every timeout "
            "and knob mkernel reads is here.", "",
            "| variable | default | meaning |", "| --- | --- | --- |"]
    for v in VARS.values():
        default = ("`~/.cache/mkernel`" if v.name == "MKERNEL_CACHE_DIR"
                   else (f"`{v.default}`" if v.default else "(unset)"))
        rows.append(f"| `{v.name}` | {default} | {v.doc} |")
    return "\n".join(rows) + "\n"
