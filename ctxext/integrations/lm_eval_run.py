"""lm-evaluation-harness's own command line with the ``ctxext`` model type registered: :func:`run_lm_eval`.

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so ``lm_eval --model ctxext`` works
only once :mod:`ctxext.integrations.lm_eval` is imported. :func:`run_lm_eval` imports it, refuses bad input before
lm-eval loads any model or task (:mod:`ctxext.integrations.lm_eval_checks`), and runs lm-eval's command line on the
arguments given. Importing this module loads nothing of lm-eval: :func:`require_lm_eval` says when it is missing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence

from ..compat import lm_eval as lm_eval_compat

HELP_FLAGS = ("-h", "--help")


def require_lm_eval() -> None:
    """Raise OSError naming the extra to install where lm-eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise OSError("`ctxext lm-eval` needs lm-eval: pip install 'ctxext[eval]'") from None


def run_lm_eval(argv: Sequence[str]) -> int:
    """Run lm-eval's command line on ``argv`` (its arguments, without a program name), with ``--model ctxext``
    registered; returns lm-eval's exit code (0: done; 2: its own usage error). Bad input is refused first with a
    ValueError or OSError: the ``--model_args`` items as written, then (after lm-eval's own parser) the checks of
    :func:`ctxext.integrations.lm_eval_checks.precheck`. With ``-h`` / ``--help``, lm-eval prints its help."""
    require_lm_eval()
    from . import lm_eval as _registers_model  # noqa: F401  registers --model ctxext
    from .lm_eval_checks import check_model_args_tokens

    argv = list(argv)
    if not set(HELP_FLAGS) & set(argv):
        check_model_args_tokens(argv)
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv  # lm-eval's parser reads sys.argv
    try:
        with pool_start_method_safe_after_threads():
            _harness_main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        sys.argv = saved
    return 0


@contextlib.contextmanager
def pool_start_method_safe_after_threads():
    """lm-eval's bootstrap standard errors (perplexity, f1, bleu, ...) run in a ``multiprocessing.Pool`` unless
    ``DISABLE_MULTIPROC`` is set. By then torch, tokenizers and tqdm have started threads, and on Linux the Pool
    *forks*: a child can inherit a lock another thread held and wait on it for ever (seen once in CI, a worker stuck
    in a futex for 11 minutes). ``forkserver`` (Python 3.14's default on Linux) starts workers from a clean server
    process instead. While lm-eval runs, a ``fork`` start method (or none chosen yet: libraries often fix the
    platform default just by asking for it) becomes ``forkserver``; ``spawn`` is already safe and kept. The previous
    setting is put back after."""
    import multiprocessing

    before = multiprocessing.get_start_method(allow_none=True)
    if before not in (None, "fork") or "forkserver" not in multiprocessing.get_all_start_methods():
        yield
        return
    multiprocessing.set_start_method("forkserver", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(before, force=True)  # None: back to "not chosen"


def _harness_main() -> None:
    """lm-eval's command line on ``sys.argv``: its parser first (its usage errors, exit 2, and --help, exit 0), then
    ctxext's checks, then lm-eval's run."""
    try:  # lm-eval >= 0.4.9: subcommands (run / ls / validate); `run` is inserted when none is given
        HarnessCLI = lm_eval_compat.harness_cli()
        from lm_eval.utils import setup_logging
    except ImportError:  # older lm-eval: one flat command
        from lm_eval.__main__ import cli_evaluate

        with lm_eval_compat.git_hash_quietly():
            cli_evaluate()
        return
    from .lm_eval_checks import precheck

    parser = HarnessCLI()
    parsed = parser.parse_args()  # lm-eval's own usage errors (exit 2) and --help (exit 0) come first
    with lm_eval_compat.index_built_once():  # the task index our check builds (cold cache) is the one lm-eval uses
        if getattr(parsed, "command", None) == "run":
            precheck(parsed)  # then ours, before any model or task loads
        setup_logging()
        with lm_eval_compat.git_hash_quietly():
            parser.execute(parsed)
