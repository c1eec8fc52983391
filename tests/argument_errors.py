"""What the tests of argument checking share: run callables that must raise mkernel.ArgumentError."""

from mkernel.errors import ArgumentError


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
