"""Positional methods as pure functions of the original values and the method's options."""
