"""What the tests of argument checking share: run callables that must raise mkernel.ArgumentError."""

from mkernel.core.errors import ArgumentError


def argument_errors(cases):
    """(missed, wrong): the names of the callables in ``cases`` (name -> callable) that raised
    nothing, and of those that raised something other than ArgumentError (with what)."""
    missed, wrong = [], []
    for name, fn in cases.items():
        try:
            fn()
            missed.append(name)
        except ArgumentError:
            pass
        except Exception as e:  # noqa: BLE001  (reported)
            wrong.append(f"{name}: {type(e).__name__}: {str(e)[:120]}")
    return missed, wrong


def refused_before_launch(comm, cases, valid_call, timeout_s=60.0):
    """(ok, message) of an op's argument checks: every callable in ``cases`` raises ArgumentError,
    nothing was launched (the communicator's epoch did not move), and ``valid_call()`` -> (ok,
    message), run afterwards, is right."""
    from mkernel.testing import sync_or_exit

    sync_or_exit("before the argument errors", timeout_s)
    e0 = comm.sync.epoch()
    missed, wrong = argument_errors(cases)
    sync_or_exit("argument errors", timeout_s)
    e1 = comm.sync.epoch()
    comm.check()
    valid_ok, valid_msg = valid_call()
    msg = (f"no ArgumentError: {missed}; other exceptions: {wrong}" if missed or wrong else
           f"all {len(cases)} raised ArgumentError") + f"; valid call after: {valid_msg}"
    if e1 != e0:
        msg += f"; LAUNCHED (epoch {e0} -> {e1})"
    return not missed and not wrong and valid_ok and e1 == e0, msg
