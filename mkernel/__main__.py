"""Command line: ``python -m mkernel [run|info|precompile|env]``.

``run`` (the default) runs every fused kernel that exists on all visible GPUs, checks it against a
reference and prints its time against cuBLAS+NCCL; start it under ``mpirun -n <gpus>``. Without a
GPU it says so in one line and exits with status 2.
"""

import argparse
import sys

EXIT_NO_GPU = 2


def _cmd_info(args):
    from mkernel.diagnostics import info
    print("\n".join(info.collect()))
    return 0


def _precompile_one(name):
    import time

    import mkernel  # noqa: F401  (registers every kernel)
    from mkernel.runtime import compile as kcompile
    t = time.perf_counter()
    c = kcompile.compile_spec(kcompile.REGISTRY[name])
    return f"{name:32s} {c.spec.source:24s} {time.perf_counter() - t:6.2f} s  key {c.key[:16]}"


def _cmd_precompile(args):
    import time

    import mkernel  # noqa: F401  (registers every kernel)
    from mkernel.runtime import compile as kcompile
    names = args.kernels or sorted(kcompile.REGISTRY)
    if args.jobs > 1:  # forked workers (no CUDA context yet); the cache is written by atomic renames
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            lines = list(pool.map(_precompile_one, names))
    else:
        lines = map(_precompile_one, names)
    for line in lines:
        print(line)
    if not args.kernels:  # the split policy's host library too (comm_sms="auto"): no g++ run at a first call
        from mkernel.split import policy as split
        t = time.perf_counter()
        split.library()
        print(f"{'split policy (host library)':32s} {'split_policy.cuh':24s} {time.perf_counter() - t:6.2f} s")
    print(f"cache: {kcompile.cache_dir()}")
    return 0


def _cmd_env(args):
    from mkernel.core import env
    if args.markdown:
        sys.stdout.write(env.markdown())
    else:
        for v in env.VARS.values():
            print(f"{v.name}={v.raw()}")
    return 0


def _cmd_run(args):
    from mkernel.runtime import gpu
    if gpu.device_count() == 0:
        print(f"mkernel: no GPU: {gpu.describe_missing()}; nothing to run.", file=sys.stderr)
        return EXIT_NO_GPU
    from mkernel.diagnostics import main_job
    return main_job.run(quick=args.quick)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mkernel", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("run", help="run, check and time every fused kernel (default)")
    r.add_argument("--quick", action="store_true", help="one small shape per op")
    sub.add_parser("info", help="versions, GPUs, links, MPI, transports, cache")
    pc = sub.add_parser("precompile", help="compile every kernel into the cache (no GPU needed)")
    pc.add_argument("kernels", nargs="*")
    pc.add_argument("--jobs", type=int, default=1, help="kernels compiled at once, each in its own process")
    e = sub.add_parser("env", help="the MKERNEL_* variables and their values")
    e.add_argument("--markdown", action="store_true")
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in sub.choices and argv[0] not in ("-h", "--help"):
        argv = ["run"] + argv  # `python -m mkernel [--quick]` is the main job
    args = p.parse_args(argv)
    return {"run": _cmd_run, "info": _cmd_info, "precompile": _cmd_precompile, "env": _cmd_env}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
