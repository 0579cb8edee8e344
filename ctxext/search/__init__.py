"""Searches that produce a model's positional settings: LongRoPE's per-dimension factors (``ctxext search longrope``)."""

from .evolution import SearchSettings
from .longrope import longrope_search
from .longrope_factors import rescaled, start_points

__all__ = ["SearchSettings", "longrope_search", "rescaled", "start_points"]
