"""`ctxext lab`: the textbook position-encoding claims reproduced from scratch on tiny decoders.

Tiny decoders that differ only in their position encoding (``positions.SCHEMES``) are trained at one length
on the shipped Austen novels mixed with a copy task, then evaluated at 1x-8x that length (``run.run_lab``).
``shift.run_shift`` is the start-offset probe: the same windows read at absolute positions k..k+W-1.
``copytask.run_copy`` is the encoder copy task of the write-up the lab starts from (peluche, 2023, "Positional
Encoding for Self Attention"): tiny bidirectional encoders (``encoder.py``), several seeds per scheme.
"""

from .positions import DEFAULT_SCHEMES, SCHEMES

__all__ = ["DEFAULT_SCHEMES", "SCHEMES"]
