"""`ctxext lab`: the textbook position-encoding claims reproduced from scratch on tiny decoders.

Tiny decoders that differ only in their position encoding (``positions.SCHEMES``) are trained at one length
on the shipped Austen novels mixed with a copy task, then evaluated at 1x-8x that length (``run.run_lab``).
``shift.run_shift`` is the start-offset probe: the same windows read at absolute positions k..k+W-1.
"""

from .positions import DEFAULT_SCHEMES, SCHEMES

__all__ = ["DEFAULT_SCHEMES", "SCHEMES"]
