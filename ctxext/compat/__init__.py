"""Every private reach into another library, gathered in one module per library (issue 26).

ctxext hooks into surfaces that transformers, lm-eval and torch expose but do not promise to keep (an underscore
attribute, a module-level helper, a private op). Each reach is one small named function or constant here, with a
comment naming the releases it was checked on and why it is needed, so an upgrade that moves one breaks in one
place, and ``tests/test_compat.py`` keeps them proved and keeps new ones from spreading. These modules sit at the
bottom of the import layers: they import nothing from ctxext.
"""
