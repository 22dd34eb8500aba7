"""One exception hierarchy, rooted at SymcommError.

Bad-argument errors also derive from the matching built-in (ValueError, TypeError), so callers
that already catch those keep working.
"""
from __future__ import annotations


def shown(value: object) -> str:
    """``value`` for an error message: its repr, but a bool marked as one (the rules that print
    it refuse bools as numbers), and an int too long to print (Python refuses past 4,300
    digits, and thousands of digits help nobody) by its size."""
    if isinstance(value, bool):  # it passes for 0 or 1 by the numbers, so say why it is refused
        return f"{value!r} (a bool)"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of {value.bit_length()} bits"
    return repr(value)


class SymcommError(Exception):
    """Base of every error symcomm raises on purpose."""


class ArgumentError(SymcommError, ValueError):
    """A call's arguments break a rule. Raised before the call moves any data (where the ranks
    compare calls, after telling the peers why: Communicator.refused)."""


class DtypeError(ArgumentError, TypeError):
    """A tensor's dtype is not supported by the requested operation or path."""


class CommClosedError(SymcommError):
    """The communicator was used after close()."""


class NcclError(SymcommError):
    """An NCCL call returned an error code."""

    def __init__(self, call: str, code: int, name: str, message: str, last_error: str = ""):
        self.call = call
        self.code = code
        self.name = name
        self.last_error = last_error
        detail = f"{call} failed: {name} ({code}): {message}"
        if last_error:
            detail += f"; last error: {last_error}"
        super().__init__(detail)


class NcclUnavailableError(SymcommError):
    """No usable libnccl could be loaded."""


class SymmetricMemoryError(SymcommError):
    """Symmetric memory cannot do what was asked (exhausted, unavailable, during capture)."""


class PeerMismatchError(SymcommError):
    """Ranks disagree about a call (sizes, dtype, window offsets...), or one refused it: found by
    check mode, or by the comparison every call on CPU tensors makes."""

    def within(self, op: str) -> PeerMismatchError:
        """This error as ``op`` raises it: a composite operation's inner collective names itself,
        but the caller made ``op``."""
        return self if str(self).startswith(f"{op}:") else PeerMismatchError(f"{op}, in its {self}")


class CommTimeoutError(SymcommError, TimeoutError):
    """A bounded wait on peers ran out."""


class CudaError(SymcommError):
    """A CUDA runtime call in symcomm's own kernels' library failed."""

    def __init__(self, what: str, code: int, message: str):
        self.what = what
        self.code = code
        super().__init__(f"{what} failed: CUDA error {code}: {message}")
