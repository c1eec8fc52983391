"""GPU checks in child processes: a case that hangs (killed at the timeout) or leaves a sticky CUDA
error kills only its own process, and the remaining cases go on in a fresh one.

A test file ``T`` defines ``run_case(case) -> (ok, message)`` and ends with
``if __name__ == "__main__": child_cases.main(run_case, all_cases)``; its tests call
``child_cases.run(__file__, cases)`` or ``child_cases.feature(__file__, name)``. The child is the
test file run as a module from the repository root (``python3 -m tests.gpu.test_x --child CASE``),
so that its ``tests.helpers`` imports resolve."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: the children run there


def _module(test_file) -> str:
    """The dotted name of a test file under the repository (tests/gpu/test_x.py: tests.gpu.test_x)."""
    return ".".join(Path(test_file).resolve().relative_to(ROOT).with_suffix("").parts)


def _child(run_case, cases):
    for case in cases:
        print(f"START {case}", flush=True)
        try:
            ok, msg = run_case(case)
        except Exception as e:  # noqa: BLE001
            ok, msg = False, f"{type(e).__name__}: {str(e)[:600]}".replace("\n", " ")
        print(f"RESULT {case} {'OK' if ok else 'FAIL'} {msg}", flush=True)


def main(run_case, all_cases, doc=""):
    """The child side: ``python3 -m T --child CASE...`` (or ``--child all``)."""
    if len(sys.argv) >= 2 and sys.argv[1] == "--child":
        cases = sys.argv[2:]
        _child(run_case, all_cases() if cases == ["all"] else cases)
    else:
        print(doc)


def run(test_file, cases, per_process_timeout=240):
    """Runs the cases in child processes of ``test_file``; a case that kills its process is
    reported as CRASH and the rest continue in a fresh process. Returns ({case: (status, message)},
    {case: the lines it printed})."""
    results, remaining, details = {}, list(cases), {}
    while remaining:
        try:
            cmd = [sys.executable, "-m", _module(test_file), "--child", *remaining]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=per_process_timeout, cwd=str(ROOT))
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as e:
            def text(x):
                return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
            stdout, stderr, rc = text(e.stdout), text(e.stderr), "timeout"
        started = None
        for line in stdout.splitlines():
            if line.startswith("START "):
                started = line.split()[1]
            elif line.startswith("RESULT "):
                _, case, status, *msg = line.split(" ")
                results[case] = (status, " ".join(msg))
                started = None
            elif started is not None:
                details.setdefault(started, []).append(line)
        if started is not None or rc != 0:
            victim = started or next((c for c in remaining if c not in results), None)
            tail = (stdout + stderr).strip().splitlines()[-3:]
            if victim is not None and victim not in results:
                results[victim] = ("CRASH", f"rc={rc} " + " | ".join(tail)[:400])
        remaining = [c for c in remaining if c not in results]
    return results, details


def feature(test_file, name):
    """Runs ``feature:NAME`` in a child process, prints what it printed, asserts it passed."""
    case = f"feature:{name}"
    results, details = run(test_file, [case])
    status, msg = results[case]
    print(f"\n==== {name}: {status} {msg}")
    for line in details.get(case, []):
        print("   ", line)
    assert status == "OK", f"{name}: {status} {msg}"


def report(title, cases, results, width=44):
    """Prints one line per case, then asserts that every case passed."""
    print(f"\n==== {title} ====")
    for c in cases:
        print(f"{results[c][0]:5s} {c:{width}s} {results[c][1]}")
    bad = [c for c in cases if results[c][0] != "OK"]
    print(f"==== {len(cases) - len(bad)}/{len(cases)} OK ====", flush=True)
    assert not bad, f"{len(bad)} failing cases, first: {bad[0]} {results[bad[0]]}"
