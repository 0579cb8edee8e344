"""Architecture census: every causal-LM class of the installed transformers, built tiny, against every method.

The rooms: ``build`` makes the tiny models, ``check`` patches each with each method and checks the result
(``parity`` holds the transformers rope-type references), ``report`` prints the model x method table.
``run_census`` returns rows; ``format_census`` prints them (``ctxext methods --census``).
"""

from .build import FACTOR, L0, SEQ, WINDOW, build_tiny, causal_lm_entries, tiny_config
from .check import Row, check_method, run_census
from .report import format_census, summarize

__all__ = ["FACTOR", "L0", "SEQ", "WINDOW", "Row", "build_tiny", "causal_lm_entries", "check_method",
           "format_census", "run_census", "summarize", "tiny_config"]
