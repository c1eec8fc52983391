"""Trace mode: ``MKERNEL_TRACE=path`` makes kernels record spans, written as Chrome trace JSON.

Open the file in Perfetto (ui.perfetto.dev) or chrome://tracing: one process per rank, one track
per SM, a slice per span named by its role and id.
"""

import json

from mkernel.core import env

ROLES = ["compute", "intra-node", "send", "recv", "wait", "control"]
WORDS = 4  # MK_TRACE_WORDS
DEFAULT_CAPACITY = 1 << 20


class Trace:
    """The device buffer one communicator's kernels append spans to, when MKERNEL_TRACE is set."""

    def __init__(self, rank: int, capacity: int = DEFAULT_CAPACITY):
        import cupy

        self.rank = rank
        self.path = env.get("MKERNEL_TRACE")
        self.capacity = capacity if self.path else 0
        self.events = cupy.zeros(self.capacity * WORDS, dtype=cupy.uint64) if self.path else None
        self.count = cupy.zeros(1, dtype=cupy.uint32) if self.path else None

    def pointers(self):
        """(events, count, capacity) for MkSync; zeros when tracing is off."""
        if not self.path:
            return 0, 0, 0
        return self.events.data.ptr, self.count.data.ptr, self.capacity

    def spans(self):
        if not self.path:
            return []
        n = min(int(self.count.get()[0]), self.capacity)
        raw = self.events[: n * WORDS].get().reshape(n, WORDS)
        return [(int(s), int(e), int(w >> 32), int(w & 0xFFFFFFFF), int(r >> 32), int(r & 0xFFFFFFFF))
                for s, e, w, r in raw]

    def chrome_events(self, spans=None):
        spans = self.spans() if spans is None else spans
        t0 = min((s[0] for s in spans), default=0)
        out = []
        for start, end, sm, block, role, ident in spans:
            name = ROLES[role] if role < len(ROLES) else f"role{role}"
            out.append({"name": f"{name} {ident}", "cat": name, "ph": "X", "pid": self.rank, "tid": sm,
                        "ts": (start - t0) / 1e3, "dur": max(end - start, 1) / 1e3,
                        "args": {"block": block, "id": ident}})
        return out

    def write(self):
        if not self.path:
            return
        path = self.path.replace("{rank}", str(self.rank))
        if "{rank}" not in self.path:
            path = f"{self.path}.rank{self.rank}.json"
        with open(path, "w") as f:
            spans = self.spans()  # ts is relative to the first span; t0_ns (%globaltimer) aligns ranks of one GPU
            json.dump({"traceEvents": self.chrome_events(spans), "displayTimeUnit": "ns",
                       "otherData": {"t0_ns": min((sp[0] for sp in spans), default=0)}}, f)
