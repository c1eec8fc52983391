"""A shape's plan and its launch templates, as every op keeps them in ``comm.plans``: the plan's
buffers (symmetric flags, views of the communicator's scratch, zeroed local words), built at the
shape's first call, and per plan the prepared kernel arguments of each call variant.

CuPy is imported inside functions: importing this module needs neither a GPU nor CuPy.
"""

from mkernel.comm.scratch import layout as scratch_layout
from mkernel.core.errors import WorkspaceError
from mkernel.runtime.arrays import cupy_mod

MAX_TEMPLATES = 16  # launch templates per plan: the call variants (K or N, layout, path, ...) seen with its buffers


def plan_buffers(op, comm, key, sizes, local_words, scratch_start=0):
    """The plan of one (op, shape key) in ``comm.plans``, built at the shape's first call (collective):
    its flags (uint32 buffers: symmetric, the plan's own, zeroed before first use), its other buffers
    (transient within a call: views of the communicator's scratch, from ``scratch_start`` on:
    mkernel/comm/scratch.py), ``scratch_end``, and per name in ``local_words`` that many device words,
    zero (``counters``: zero between launches).

    sizes: [(name, shape, dtype)]; local_words: {name: words}."""
    plan = comm.plans.get(key)
    if plan is not None:
        return plan
    import numpy

    cupy = cupy_mod()
    flags = [(n, s, d) for n, s, d in sizes if numpy.dtype(d) == numpy.uint32]
    data = [(n, s, d) for n, s, d in sizes if numpy.dtype(d) != numpy.uint32]
    try:
        plan = comm.scratch.views(op, data, scratch_start)  # first: growing it releases the cached plans
        for name, shape, dt in flags:
            plan[name] = comm.empty(shape, dt)
    except WorkspaceError as e:
        need = sum(nbytes(shape, dt) for _, shape, dt in sizes)
        raise WorkspaceError(f"{op}: needs {need} bytes of symmetric workspace for this shape ({e})") from e
    for name, _, _ in flags:
        plan[name].data.memset_async(0, plan[name].nbytes)  # a memset, not a kernel: see calls.quiesced_first_use
    plan["scratch_end"] = scratch_start + scratch_layout(data)[0]
    for name, words in local_words.items():
        plan[name] = cupy.zeros(words, dtype=cupy.uint32)
    cupy.cuda.runtime.deviceSynchronize()  # zeroed before this rank announces any credit
    return comm.plans.add(key, plan)


def nbytes(shape, dt):
    import numpy
    n = 1
    for s in shape:
        n *= int(s)
    return n * numpy.dtype(dt).itemsize


def launch_template(plan, key, build):
    """The prepared arguments of ``key`` within ``plan``: every field but the operands' pointers and
    the per-call fields, built by ``build()`` at the key's first call; evicted with the plan."""
    templates = plan.setdefault("launch", {})
    t = templates.get(key)
    if t is None:
        if len(templates) >= MAX_TEMPLATES:
            del templates[next(iter(templates))]
        t = templates[key] = {"args": build(), "maps": {}}
    return t


def operand_map(template, role, key, encode):
    """``encode()``'s TMA map for an operand, encoded again only when ``key`` (its pointer and
    strides) differs from the template's last call."""
    last = template["maps"].get(role)
    if last is None or last[0] != key:
        last = template["maps"][role] = (key, encode())
    return last[1]
