"""lm-eval's task names, checked before anything of lm-eval's runs: :func:`check_tasks` refuses a ``--tasks`` entry
that lm-eval's task index does not hold (with suggestions), and :func:`task_names` reads that index through a cache.

Indexing lm-eval's ~14,000 task YAML files takes 15-20 s on a 2-core machine, so the names are cached per lm-eval
installation in ctxext's cache folder (:func:`cache_dir`). lm-eval is imported inside the functions: importing this
module loads nothing of it.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.outputs import write_atomic


def cache_dir() -> Path:
    """ctxext's own cache: ``$CTXEXT_CACHE_DIR``, else ``$XDG_CACHE_HOME/ctxext``, else ``~/.cache/ctxext``."""
    if os.environ.get("CTXEXT_CACHE_DIR"):
        return Path(os.environ["CTXEXT_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ctxext"


def check_tasks(tasks, include_path) -> None:
    """Refuse task names that lm-eval's task index does not hold, as lm-eval's own ``process_tasks`` would (names
    and glob patterns against every task, group and tag; ``.yaml`` paths and globs must match a file; a single
    directory is lm-eval's to read), but before anything else of lm-eval's runs, and with suggestions."""
    import difflib
    import glob

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
    data loads), with ``include_path``'s. The names of lm-eval's own task folder are cached in :func:`cache_dir`,
    keyed by the lm-eval version and the path, size and modification time of every YAML file there (about 0.2 s to
    read for ~14,000 files), so a changed or reinstalled lm-eval is indexed afresh; where the cache cannot be
    written, each run indexes (15-20 s on a 2-core machine). Within ``index_built_once`` (ctxext.compat.lm_eval),
    the index built here on a cold cache is the one lm-eval's run then uses."""
    import hashlib
    import importlib.metadata
    import inspect
    import json

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
    cache = cache_dir() / f"lm_eval_tasks-{version}-{digest.hexdigest()[:20]}.json"
    try:
        names = json.loads(cache.read_text())
        if not isinstance(names, list):
            raise ValueError("not a list")
    except (OSError, ValueError):
        names = list(TaskManager().all_tasks)
        try:
            write_atomic(cache, json.dumps(names))
        except OSError:  # a cache that cannot be written is skipped: the next run indexes again
            pass
    if include_path:
        names = sorted(set(names) | set(TaskManager(include_path=include_path, include_defaults=False).all_tasks))
    return names
