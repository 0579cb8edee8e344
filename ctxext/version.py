"""The version of ctxext (also in pyproject.toml): a module of its own, so that any layer may import it."""

__version__ = "0.1.0.dev0"
