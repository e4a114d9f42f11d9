"""The one exception hierarchy of onecopy.

Every error is one sentence a user can act on: what went wrong, where (file, method, delegate, option), and how
to fix it. Catch `OnecopyError` to catch them all.
"""

from __future__ import annotations

__all__ = [
    "OnecopyError",
    "InvalidArgument",
    "ProgramFormatError",
    "ProgramError",
    "ExportError",
    "UnsupportedOperator",
    "DelegateError",
    "ExecutionError",
    "RequestError",
    "RequestTooLarge",
    "SessionNotFound",
]


class OnecopyError(Exception):
    """Base class of every error onecopy raises on purpose."""


class InvalidArgument(OnecopyError, ValueError):
    """An argument or option given by the caller is wrong (name, type or value)."""


class ProgramFormatError(OnecopyError):
    """A program file is not a valid onecopy program (truncated, wrong magic, newer version, bad schema)."""


class ExportError(OnecopyError):
    """A model could not be exported into a program."""


class UnsupportedOperator(ExportError):
    """An operator can run neither in the engine nor on the host."""


class DelegateError(OnecopyError):
    """A delegate could not be initialized or run (manifest, bundle, compute units, engine)."""


class ExecutionError(OnecopyError):
    """A method was called with inputs or outputs it cannot take."""


class RequestError(InvalidArgument):
    """A request to a served program is malformed: its payload, content type or route (onecopy.serve)."""


class RequestTooLarge(RequestError):
    """A request to a served program is over the deployment's size limit (onecopy.serve)."""


class SessionNotFound(ExecutionError):
    """A call to a stateful method named a session that this replica does not hold (onecopy.serve)."""


# The name issue #16 gives a damaged or foreign program file's error: the same class.
ProgramError = ProgramFormatError
