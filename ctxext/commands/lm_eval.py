"""`ctxext lm-eval ...`: lm-evaluation-harness with the `ctxext` model type registered.

lm-eval 0.4.13 finds models only in its own registry (no plugin entry points), so `lm_eval --model
ctxext` works only once :mod:`ctxext.integrations.lm_eval` is imported. This command imports it and hands
every remaining argument to lm-eval's own command line:

    ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 --tasks TASKS
    python -m ctxext lm-eval ...        (same, without the console script)

Bad input is refused before lm-eval loads any model or task (which alone takes from seconds to minutes), as
`ctxext eval` refuses its own: one ``ctxext lm-eval: error: ...`` line, exit code 2. First the ``--model_args``
items as written (an item without ``=``, a key given twice: lm-eval would keep the last), then lm-eval's own
argument parser, then :func:`precheck`: ``--tasks``, ``--include_path``, for ``--model ctxext`` the model_args
(:func:`ctxext.integrations.lm_eval.check_model_args`: unknown keys, empty values, dtypes, method, factor, options), the
model's source and whether the method fits the model's family (on a weightless skeleton), and last the task names,
against lm-eval's own task index (no task data loads). Indexing lm-eval's ~14,000 task YAML files takes 15-20 s on a
2-core machine, so the names are cached per lm-eval installation (:func:`task_names`); the first run's index is
the one lm-eval then uses (:func:`index_built_once`), so it is built once either way.
With no arguments it prints its usage and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from ..compat import lm_eval as lm_eval_compat


def register(sub) -> None:
    p = sub.add_parser(
        "lm-eval", help="run lm-evaluation-harness with the `ctxext` model type (patched models)",
        description="lm-evaluation-harness with `--model ctxext` registered; every argument after `lm-eval` "
        "goes to lm-eval, e.g. `ctxext lm-eval --model ctxext --model_args pretrained=DIR,method=yarn,factor=4 "
        "--tasks hellaswag`. ctxext model_args: pretrained, gguf_file, adapter, method, factor, and the method's "
        "options (e.g. beta_fast=32); the rest are lm-eval's `hf` model_args.",
        add_help=False,
        prefix_chars="+",  # every argument, `--model` included, is lm-eval's
    )
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


USAGE = (
    "usage: ctxext lm-eval --model ctxext --model_args pretrained=DIR[,method=METHOD,factor=F,OPTION=V,...]\n"
    "                      --tasks TASK[,TASK...] [lm-eval options]   (ctxext lm-eval --help: lm-eval's help)"
)


HELP = (
    "ctxext lm-eval: lm-evaluation-harness with `--model ctxext` registered; every argument goes to lm-eval.\n"
    "  ctxext lm-eval --model ctxext --model_args pretrained=DIR[,method=METHOD,factor=F,OPTION=V,...] --tasks TASKS\n"
    "ctxext model_args: pretrained, gguf_file, adapter, method, factor, the method's options (e.g. beta_fast=32);\n"
    "the rest are lm-eval's `hf` model_args. They are checked before any task loads. lm-eval's own help follows.\n"
)


def run(args) -> int:
    argv = list(args.lm_eval_args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print(USAGE, file=sys.stderr)
        raise ValueError("nothing to run: give --model ctxext --model_args pretrained=DIR,... --tasks TASKS")
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise OSError("`ctxext lm-eval` needs lm-eval: pip install 'ctxext[eval]'") from None
    from ..integrations import lm_eval as _registers_model  # noqa: F401  registers --model ctxext

    if argv[0] in ("-h", "--help"):
        print(HELP)
    elif not {"-h", "--help"} & set(argv):
        check_model_args_tokens(argv)
    saved = sys.argv
    sys.argv = ["lm-eval"] + argv  # lm-eval's parser reads sys.argv
    try:
        with pool_start_method_safe_after_threads():
            _lm_eval_main()
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


def _lm_eval_main() -> None:
    try:  # lm-eval >= 0.4.9: subcommands (run / ls / validate); `run` is inserted when none is given
        HarnessCLI = lm_eval_compat.harness_cli()
        from lm_eval.utils import setup_logging
    except ImportError:  # older lm-eval: one flat command
        from lm_eval.__main__ import cli_evaluate

        with lm_eval_compat.git_hash_quietly():
            cli_evaluate()
        return
    parser = HarnessCLI()
    parsed = parser.parse_args()  # lm-eval's own usage errors (exit 2) and --help (exit 0) come first
    with index_built_once():  # the task index our check builds (cold cache) is the one lm-eval then uses
        if getattr(parsed, "command", None) == "run":
            precheck(parsed)  # then ours, before any model or task loads
        setup_logging()
        with lm_eval_compat.git_hash_quietly():
            parser.execute(parsed)


def _model_args_tokens(argv: list[str]) -> list[str]:
    """The values given to lm-eval's ``--model_args`` / ``-a`` (``nargs="+"``: every following token up to the next
    option), in the forms people write; an unusual spelling is left to lm-eval's parser."""
    tokens, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        if arg in ("--model_args", "-a") or _abbreviates_model_args(arg):
            i += 1
            while i < len(argv) and not argv[i].startswith("-"):
                tokens.append(argv[i])
                i += 1
            continue
        if "=" in arg and (arg.startswith("--model_args=") or _abbreviates_model_args(arg.split("=", 1)[0])):
            tokens.append(arg.split("=", 1)[1])
        i += 1
    return tokens


def _abbreviates_model_args(arg: str) -> bool:
    """``--model_a``, ``--model_arg``: argparse takes an unambiguous prefix of a long option (``--model`` itself is
    the model type, an exact match)."""
    return len(arg) > len("--model") and "--model_args".startswith(arg)


def check_model_args_tokens(argv: list[str]) -> None:
    """Refuse a ``--model_args`` item without ``=`` or with no key, and a key given twice (in one value or across
    several ``--model_args``), before lm-eval's parser merges them (it keeps the last value of a repeated key)."""
    import json

    from ..integrations.lm_eval import check_model_args_items

    if argv and argv[0] in ("ls", "validate"):
        return
    split_top_level = lm_eval_compat.model_args_splitter()  # how lm-eval splits key=value,key=value
    items: list[str] = []
    for token in _model_args_tokens(argv):
        if token.lstrip().startswith("{"):  # JSON: lm-eval parses it (and reports bad JSON) itself
            try:
                pairs = json.loads(token, object_pairs_hook=lambda kv: kv)
            except json.JSONDecodeError:
                continue
            if isinstance(pairs, list):
                items += [f"{k}={json.dumps(v)}" for k, v in pairs]
            continue
        items += split_top_level(token)
    check_model_args_items(items)


def precheck(parsed) -> None:
    """Refuse bad input to `lm-eval run` before any model or task loads: the settings as lm-eval itself merges
    them (``--config`` YAML, then the command line), ``--tasks`` and ``--include_path``, for ``--model ctxext`` its
    model_args (see :func:`ctxext.integrations.lm_eval.check_model_args`), the model's source, and whether the method fits
    its family; then the task names (:func:`check_tasks`)."""
    import io
    import logging
    from pathlib import Path

    from ..integrations.lm_eval import check_batch, check_model_args

    if not getattr(parsed, "tasks", None) and not getattr(parsed, "config", None):
        raise ValueError("--tasks is required, e.g. --tasks hellaswag (`ctxext lm-eval ls tasks` lists them)")
    include = getattr(parsed, "include_path", None)
    if include and not Path(include).expanduser().exists():
        raise FileNotFoundError(f"--include_path: not found: {include}")
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:  # pragma: no cover - lm-eval < 0.4.9 has no config object; check what the CLI gave
        model, model_args = getattr(parsed, "model", None), getattr(parsed, "model_args", None) or {}
        tasks, include = parsed.tasks, include
        metadata, settings = None, parsed
    else:
        copy = argparse.Namespace(**{k: dict(v) if isinstance(v, dict) else v for k, v in vars(parsed).items()})
        quiet = io.StringIO()
        disabled = logging.root.manager.disable
        logging.disable(logging.WARNING)  # lm-eval warns (e.g. about --limit) again when it really runs
        try:
            with contextlib.redirect_stdout(quiet):  # it prints a --config's merged settings, likewise
                cfg = EvaluatorConfig.from_cli(copy)
        except TypeError as exc:  # a --config YAML whose root is not a mapping
            raise ValueError(str(exc)) from None
        finally:
            logging.disable(disabled)
        model, model_args = cfg.model, cfg.model_args or {}
        tasks, include = cfg.tasks, cfg.include_path
        metadata = cfg.metadata or {}  # merged: model_args | --metadata (and a --config's)
        settings = cfg
    if model == "ctxext":
        if isinstance(model_args, str):
            from lm_eval.utils import simple_parse_args_string

            model_args = simple_parse_args_string(model_args)
        checked = check_model_args(model_args)
        for key in ("batch_size", "max_batch_size", "device"):  # lm-eval passes its own as keywords too
            if key in model_args and getattr(settings, key, None) is not None:
                raise ValueError(f"model_args: {key}= is lm-eval's --{key} (given in both, the model type gets it "
                                 f"twice); give --{key} only")
        check_batch(checked["method"], model_args.get("batch_size", getattr(settings, "batch_size", None)))
        if checked["method"] is not None:
            check_fits(model_args, checked)
    _check_output_path(getattr(settings, "output_path", None))
    check_tasks(tasks, include)  # last: on a cold cache it indexes lm-eval's task files
    if model == "ctxext" and metadata is not None and isinstance(model_args, dict):
        folder = ruler_tokenizer(model_args, tasks, metadata)
        if folder is not None:
            # the merged metadata (a --config's too: lm-eval lets the command line's replace it whole)
            parsed.metadata = {**metadata, "tokenizer": folder}


def _check_output_path(value) -> None:
    """lm-eval writes results into a folder (or a ``.json`` file path); an existing file there is found only after the
    whole run, which then ends with exit 0 and no results."""
    from pathlib import Path

    if not value:
        return
    path = Path(str(value)).expanduser()
    if path.exists() and not path.is_dir() and path.suffix != ".json":
        raise ValueError(f"--output_path {value}: an existing file; lm-eval writes its results into a folder there "
                         "(or to a path ending in .json)")
    parent = next((q for q in path.absolute().parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--output_path {value}: cannot be made, {parent} is a file")


#: lm-eval's RULER tasks and group, which build their samples with a tokenizer of their own
RULER_TASKS = re.compile(r"^(ruler|niah_|ruler_|qa_squad|qa_hotpot)")


def ruler_tokenizer(model_args: dict, tasks, metadata: dict) -> str | None:
    """lm-eval's RULER tasks build their samples with ``AutoTokenizer.from_pretrained(tokenizer or pretrained)``,
    which cannot read the tokenizer inside a GGUF file (it fails with "Couldn't instantiate the backend tokenizer").
    For ``--model ctxext`` with a ``gguf_file``, RULER tasks and no ``tokenizer`` in the metadata, the GGUF's
    tokenizer is saved once under ctxext's cache (``$CTXEXT_CACHE_DIR/gguf-tokenizers/``, keyed by the file's path,
    size and time) and its folder returned for the metadata; otherwise None (nothing written)."""
    import hashlib
    import shutil
    import tempfile
    from pathlib import Path

    gguf, pretrained = model_args.get("gguf_file"), model_args.get("pretrained")
    names = []
    for task in ([tasks] if isinstance(tasks, str) else list(tasks or [])):
        task = task.get("task", "") if isinstance(task, dict) else task  # an inline task config of a --config
        names += str(task).split(",")
    if not gguf or not pretrained or metadata.get("tokenizer") or not any(
            RULER_TASKS.match(n.strip()) for n in names):
        return None
    options = {k: model_args[k] for k in ("revision", "trust_remote_code") if model_args.get(k) is not None}
    path = Path(str(pretrained)).expanduser() / str(gguf)
    stamp = f"{path.resolve()}:{path.stat().st_size}:{path.stat().st_mtime_ns}" if path.is_file() else \
        f"{pretrained}:{gguf}:{sorted(options.items())}"
    folder = _cache_dir() / "gguf-tokenizers" / hashlib.sha256(stamp.encode()).hexdigest()[:16]
    if not (folder / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(pretrained), gguf_file=str(gguf), **options)
        tmp = None
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=folder.parent, prefix=".saving-")  # saved whole, then renamed into place
            os.chmod(tmp, 0o755)  # a shared cache stays readable
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, folder)
        except OSError:
            if not (folder / "tokenizer_config.json").is_file():  # not another process saving it first
                folder = Path(tempfile.mkdtemp(prefix="ctxext-gguf-tokenizer-"))  # an unwritable cache: this run's
                tokenizer.save_pretrained(folder)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    print(f"ctxext lm-eval: RULER tasks read the GGUF's tokenizer from {folder} (saved from {gguf}; give "
          "--metadata tokenizer=... to use another)", file=sys.stderr)
    return str(folder)


def check_fits(model_args: dict, checked: dict) -> None:
    """Build the model without weights from its config and check that the method fits its family."""
    from ..api import build_spec
    from ..loading import model_skeleton

    kwargs = {k: model_args[k] for k in ("revision", "trust_remote_code") if model_args.get(k) is not None}
    skeleton = model_skeleton(str(model_args["pretrained"]), gguf_file=model_args.get("gguf_file") or None, **kwargs)
    build_spec(skeleton, checked["method"], checked["factor"], **checked["options"])


def check_tasks(tasks, include_path) -> None:
    """Refuse task names that lm-eval's task index does not hold, as lm-eval's own ``process_tasks`` would (names
    and glob patterns against every task, group and tag; ``.yaml`` paths and globs must match a file; a single
    directory is lm-eval's to read), but before anything else of lm-eval's runs, and with suggestions."""
    import glob
    import difflib
    from pathlib import Path

    try:
        from lm_eval.utils import pattern_match
    except ImportError:  # pragma: no cover
        import fnmatch

        def pattern_match(patterns, names):
            return sorted({n for p in patterns for n in fnmatch.filter(names, p)})

    specs = tasks.split(",") if isinstance(tasks, str) else [
        part for task in tasks or [] for part in (task.split(",") if isinstance(task, str) else [task])]
    specs = [s.strip() if isinstance(s, str) else s for s in specs]
    if not any(isinstance(s, str) for s in specs):
        return  # task configs written out in a --config YAML: lm-eval checks those
    if include_path and not Path(str(include_path)).expanduser().exists():
        raise FileNotFoundError(f"include_path: not found: {include_path}")
    files = [s for s in specs if isinstance(s, str) and s.endswith(".yaml")]
    for spec in files:
        if not glob.glob(str(Path(spec).expanduser())):
            raise FileNotFoundError(f"--tasks: no task file matches {spec}")
    names_needed = [s for s in specs if isinstance(s, str) and not s.endswith(".yaml")]
    if not names_needed:
        return
    names = task_names(include_path)
    if len(specs) == 1 and Path(names_needed[0]).expanduser().is_dir() and not pattern_match(names_needed, names):
        return  # a folder of task YAML files, which lm-eval reads itself
    missing = [s for s in names_needed if not pattern_match([s], names)]
    if not missing:
        return
    parts = []
    for spec in missing:
        close = difflib.get_close_matches(spec, names, n=3, cutoff=0.75)
        parts.append(repr(spec) + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    where = "lm-eval's task index" + (f" or --include_path {include_path}" if include_path else "")
    raise ValueError(f"--tasks: unknown task(s) {', '.join(parts)}: not in {where} "
                     f"({len(names)} tasks, groups and tags; `ctxext lm-eval ls tasks` lists them)")


def task_names(include_path=None) -> list[str]:
    """Every task, group and tag name lm-eval's ``TaskManager`` knows (its index of task YAML files: no task or
    data loads), with ``include_path``'s. The names of lm-eval's own task folder are cached in
    ``$CTXEXT_CACHE_DIR`` (default ``~/.cache/ctxext``), keyed by the lm-eval version and the path, size and
    modification time of every YAML file there (about 0.2 s to read for ~14,000 files), so a changed or reinstalled
    lm-eval is indexed afresh; where the cache cannot be written, each run indexes (15-20 s on a 2-core machine)."""
    import hashlib
    import importlib.metadata
    import inspect
    import json
    from pathlib import Path

    from lm_eval.tasks import TaskManager

    folder = Path(inspect.getfile(TaskManager)).parent  # what TaskManager indexes by default
    try:
        version = importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        version = "unknown"
    digest = hashlib.sha256(f"{version}\n{folder.resolve()}\n".encode())
    for directory, subdirs, files in os.walk(folder):
        subdirs.sort()
        for name in sorted(files):
            if name.endswith(".yaml"):
                path = os.path.join(directory, name)
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    cache = _cache_dir() / f"lm_eval_tasks-{version}-{digest.hexdigest()[:20]}.json"
    try:
        names = json.loads(cache.read_text())
        if not isinstance(names, list):
            raise ValueError("not a list")
    except (OSError, ValueError):
        names = list(TaskManager().all_tasks)
        _write_atomically(cache, json.dumps(names))
    if include_path:
        names = sorted(set(names) | set(TaskManager(include_path=include_path, include_defaults=False).all_tasks))
    return names


def _cache_dir():
    from pathlib import Path

    if os.environ.get("CTXEXT_CACHE_DIR"):
        return Path(os.environ["CTXEXT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ctxext"


def _write_atomically(path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file beside it; a cache that cannot be written is skipped."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass


@contextlib.contextmanager
def index_built_once():
    """Within the block, lm-eval's task index (``TaskIndex.build``, what ``TaskManager()`` spends its time on) is
    built once per folder: the index that :func:`check_tasks` builds on a cold cache is the one lm-eval's run then
    uses, instead of a second 15-20 s. Folders are merged as lm-eval merges them (later ones override, with its
    warning). Outside the block, and with an lm-eval that has no ``TaskIndex.build``, nothing changes."""
    try:
        TaskIndex, log = lm_eval_compat.task_index()
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
