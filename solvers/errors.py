"""Exceptions raised by the torch-free planning package."""

from __future__ import annotations

__all__ = ["SolverError", "InvalidProblemError", "InfeasibleError"]


class SolverError(Exception):
    """Base class of every error raised by :mod:`solvers`."""


class InvalidProblemError(SolverError, ValueError):
    """A problem or solution document is malformed; the message names the field."""


class InfeasibleError(SolverError):
    """No partition satisfies the memory limits.

    ``min_peak_bytes`` is the smallest per-stage peak memory any partition in
    the searched space reaches: a device with at least that much memory fits.
    ``proven``: no plan of the searched space fits (False: none was found within a time limit).
    """

    def __init__(self, message: str, min_peak_bytes: float | None = None, proven: bool = True) -> None:
        super().__init__(message)
        self.min_peak_bytes = min_peak_bytes
        self.proven = proven
