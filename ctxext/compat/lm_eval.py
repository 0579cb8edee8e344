"""Private reaches into lm-evaluation-harness: the ``hf`` model's (``HFLM``) private hooks and state that ctxext's
model type overrides and reads, and the private modules of lm-eval's command line that ``ctxext lm-eval`` reuses.

Checked on lm-eval 0.4.13, the version constraints.txt pins (the only one the CI runs). lm_eval is imported inside
the functions, not here: ``ctxext.integrations.lm_eval_run`` uses this module before deciding to load lm-eval (and
where it is not installed), while ``ctxext.integrations.lm_eval`` is imported only once lm-eval is.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable

#: The lm-eval release these reaches were checked on.
TESTED_LM_EVAL = "0.4.13"

#: ``HFLM``'s private methods that ``ctxext.integrations.lm_eval.CtxextLM`` overrides, because lm-eval offers no
#: public hook for them: ``_get_config`` (read a config saved patched through ctxext's loader, where AutoConfig
#: refuses it) and ``_create_model`` (load through ``ctxext.from_pretrained``). An override of a method that lm-eval
#: renamed would silently never run, so :func:`check_hflm_hooks` refuses such an lm-eval at import.
HFLM_HOOKS = ("_get_config", "_create_model")


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("lm_eval")
    except Exception:  # noqa: BLE001 - a version is only for the message
        return "unknown"


def check_hflm_hooks(hflm: type) -> None:
    """Raise OSError naming the installed lm-eval when ``hflm`` (lm-eval's ``HFLM``) lacks one of ``HFLM_HOOKS``."""
    missing = [name for name in HFLM_HOOKS if not callable(getattr(hflm, name, None))]
    if missing:
        raise OSError(
            f"lm-eval {_version()}'s HFLM has no {', '.join(missing)}, which ctxext's lm-eval model overrides; "
            f"ctxext is tested with lm-eval {TESTED_LM_EVAL}"
        )


# -- HFLM state -------------------------------------------------------------------------------------------------
# HFLM keeps the loaded model, its config and the user's ``max_length`` argument in private attributes. The public
# ``model`` property unwraps an accelerate-wrapped model and ``config`` has no setter, so ctxext reads and replaces
# what HFLM holds; the public ``max_length`` resolves a default, which hides whether the user gave one.


def loaded_model(lm):
    """The model HFLM loaded (``lm._model``, as HFLM itself holds it)."""
    return lm._model


def replace_model(lm, model) -> None:
    """Make ``lm`` evaluate ``model`` (e.g. with a LoRA adapter loaded onto it) instead."""
    lm._model = model


def set_config(lm, config) -> None:
    """What HFLM's ``_get_config`` leaves behind: the config on ``lm._config``."""
    lm._config = config


def max_length_argument(lm):
    """The ``max_length`` model argument the user gave (``lm._max_length``; None or 0 when not given)."""
    return lm._max_length


# -- lm-eval's command line ---------------------------------------------------------------------------------------


def harness_cli() -> type:
    """lm-eval's subcommand parser (``lm_eval._cli.HarnessCLI``, lm-eval >= 0.4.9); ImportError where absent."""
    from lm_eval._cli import HarnessCLI

    return HarnessCLI


def model_args_splitter() -> Callable[[str], list[str]]:
    """How lm-eval splits ``key=value,key=value`` (``lm_eval._cli.utils.split_top_level``: commas inside brackets
    or quotes stay); a plain comma split where this lm-eval has none."""
    try:
        from lm_eval._cli.utils import split_top_level
    except ImportError:  # pragma: no cover - older lm-eval
        def split_top_level(text):
            return text.split(",")
    return split_top_level


def task_index():
    """lm-eval's task index class and its logger (``lm_eval.tasks._index.TaskIndex`` and ``log``), whose static
    ``build`` ctxext wraps to build the index once per command; ImportError where absent."""
    from lm_eval.tasks._index import TaskIndex, log

    return TaskIndex, log


@contextlib.contextmanager
def index_built_once():
    """Within the block, lm-eval's task index (``TaskIndex.build``, what ``TaskManager()`` spends its time on) is
    built once per folder: the index that ctxext's task-name check builds on a cold cache is the one lm-eval's run
    then uses, instead of a second 15-20 s. Folders are merged as lm-eval merges them (later ones override, with its
    warning). Outside the block, and with an lm-eval that has no static ``TaskIndex.build``, nothing changes."""
    try:
        TaskIndex, log = task_index()
    except ImportError:  # pragma: no cover - older lm-eval
        yield
        return
    original = TaskIndex.__dict__.get("build")
    if not isinstance(original, staticmethod):  # pragma: no cover - another lm-eval
        yield
        return
    built: dict = {}

    def build(paths, *, resolve_includes=True):
        index: dict = {}
        for root in paths:
            key = (str(root), resolve_includes)
            if key not in built:
                built[key] = original.__func__([root], resolve_includes=resolve_includes)
            for name, entry in built[key].items():
                if name in index:
                    log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                index[name].yaml_path)
                index[name] = entry
        return index

    TaskIndex.build = staticmethod(build)
    try:
        yield
    finally:
        TaskIndex.build = original


__all__ = [
    "HFLM_HOOKS",
    "TESTED_LM_EVAL",
    "check_hflm_hooks",
    "git_hash_quietly",
    "harness_cli",
    "index_built_once",
    "loaded_model",
    "max_length_argument",
    "model_args_splitter",
    "replace_model",
    "set_config",
    "task_index",
]


@contextlib.contextmanager
def git_hash_quietly():
    """lm-eval records the git commit of the working directory in its results with ``git describe --always``, git's
    stderr not redirected: run outside a git checkout, every run printed ``fatal: not a git repository``. While
    ctxext's lm-eval runs, the same call with only git's own stderr discarded: the same hash where there is one, and
    lm-eval's own fallback (the ``.git`` folder read directly, else none) where git fails or is missing."""
    try:
        import lm_eval.evaluator as evaluator
        from lm_eval.loggers import utils
    except ImportError:
        yield
        return
    original = getattr(utils, "get_git_commit_hash", None)
    if original is None:
        yield
        return

    def get_git_commit_hash():
        try:
            return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
        except (subprocess.CalledProcessError, OSError):
            from_path = getattr(utils, "get_commit_from_path", None)
            return from_path(os.getcwd()) if from_path else None

    patched = [m for m in (evaluator, utils) if getattr(m, "get_git_commit_hash", None) is original]
    for module in patched:
        module.get_git_commit_hash = get_git_commit_hash
    try:
        yield
    finally:
        for module in patched:
            module.get_git_commit_hash = original
