"""What ``ctxext lm-eval`` refuses before lm-eval loads any model or task (which alone takes from seconds to minutes).

In order: :func:`check_model_args_tokens`, the ``--model_args`` items as written (an item without ``=``, a key given
twice: lm-eval's parser would keep the last); then, after lm-eval's own parser, :func:`precheck`: ``--tasks``,
``--include_path``, for ``--model ctxext`` the model_args (:func:`ctxext.integrations.lm_eval.check_model_args`:
unknown keys, empty values, dtypes, method, factor, options), the model's source and whether the method fits the
model's family (on a weightless skeleton, :func:`check_fits`), ``--output_path``, and last the task names against
lm-eval's own task index (:func:`ctxext.integrations.lm_eval_tasks.check_tasks`: no task data loads). Each refusal
is a ValueError or OSError with a one-line message.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
from pathlib import Path

from ..compat import lm_eval as lm_eval_compat
from .lm_eval import check_batch, check_model_args, check_model_args_items
from .lm_eval_ruler import ruler_tokenizer
from .lm_eval_tasks import check_tasks


def model_args_tokens(argv: list[str]) -> list[str]:
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
    if argv and argv[0] in ("ls", "validate"):
        return
    split_top_level = lm_eval_compat.model_args_splitter()  # how lm-eval splits key=value,key=value
    items: list[str] = []
    for token in model_args_tokens(argv):
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


def _merged_settings(parsed):
    """lm-eval's settings as it merges them itself (``--config`` YAML, then the command line), read from a copy of
    ``parsed``: ``(model, model_args, tasks, include_path, metadata, settings)``."""
    try:
        from lm_eval.config.evaluate_config import EvaluatorConfig
    except ImportError:  # pragma: no cover - lm-eval < 0.4.9 has no config object; check what the CLI gave
        model_args = getattr(parsed, "model_args", None) or {}
        return getattr(parsed, "model", None), model_args, parsed.tasks, getattr(parsed, "include_path", None), \
            None, parsed
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
    # metadata, merged: model_args | --metadata (and a --config's)
    return cfg.model, cfg.model_args or {}, cfg.tasks, cfg.include_path, cfg.metadata or {}, cfg


def precheck(parsed) -> None:
    """Refuse bad input to `lm-eval run` (``parsed``: lm-eval's own parsed arguments) before any model or task loads:
    the settings as lm-eval itself merges them (``--config`` YAML, then the command line), ``--tasks`` and
    ``--include_path``, for ``--model ctxext`` its model_args, the model's source, and whether the method fits its
    family; then the task names. For RULER tasks on a GGUF model, names the GGUF's tokenizer in
    ``parsed.metadata`` (:func:`ctxext.integrations.lm_eval_ruler.ruler_tokenizer`)."""
    if not getattr(parsed, "tasks", None) and not getattr(parsed, "config", None):
        raise ValueError("--tasks is required, e.g. --tasks hellaswag (`ctxext lm-eval ls tasks` lists them)")
    include = getattr(parsed, "include_path", None)
    if include and not Path(include).expanduser().exists():
        raise FileNotFoundError(f"--include_path: not found: {include}")
    model, model_args, tasks, include, metadata, settings = _merged_settings(parsed)
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
    check_output_path(getattr(settings, "output_path", None))
    check_tasks(tasks, include)  # last: on a cold cache it indexes lm-eval's task files
    if model == "ctxext" and metadata is not None and isinstance(model_args, dict):
        folder = ruler_tokenizer(model_args, tasks, metadata)
        if folder is not None:
            # the merged metadata (a --config's too: lm-eval lets the command line's replace it whole)
            parsed.metadata = {**metadata, "tokenizer": folder}


def check_output_path(value) -> None:
    """lm-eval writes results into a folder (or a ``.json`` file path); an existing file there is found only after the
    whole run, which then ends with exit 0 and no results."""
    if not value:
        return
    path = Path(str(value)).expanduser()
    if path.exists() and not path.is_dir() and path.suffix != ".json":
        raise ValueError(f"--output_path {value}: an existing file; lm-eval writes its results into a folder there "
                         "(or to a path ending in .json)")
    parent = next((q for q in path.absolute().parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"--output_path {value}: cannot be made, {parent} is a file")


def check_fits(model_args: dict, checked: dict) -> None:
    """Build the model without weights from its config and check that the method fits its family."""
    from ..api import build_spec
    from ..loading import model_skeleton

    kwargs = {k: model_args[k] for k in ("revision", "trust_remote_code") if model_args.get(k) is not None}
    skeleton = model_skeleton(str(model_args["pretrained"]), gguf_file=model_args.get("gguf_file") or None, **kwargs)
    build_spec(skeleton, checked["method"], checked["factor"], **checked["options"])
