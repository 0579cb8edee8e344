"""`ctxext search longrope`: LongRoPE's evolutionary factor search, written as a native longrope checkpoint.

    ctxext search longrope MODEL --factor 4 --out DIR [--data FILE] [--budget 48] [--minutes M] [--progressive]
                                 [--population 12] [--parents 4] [--max-windows 2] [--seed 0] [--gguf-file F]
                                 [--resume] [--overwrite]

MODEL is a hub id, a local folder (with ``--gguf-file``: a GGUF file in it) or ``reference:NAME``. Calibration text:
``--data`` (a text / JSONL file, a folder, a saved dataset), or the bundled book (held-out *Emma*). Everything is checked
before the model's weights load; the folder is refused if it exists, unless ``--resume`` (continue its log) or
``--overwrite`` (replace a folder an earlier search wrote), and where it lies inside a ``--data`` folder or holds
``--data``. The last line of the report says why the search stopped: its budget spent, ``--minutes`` out, or every
candidate within the constraint scored.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser(
        "search", help="search positional settings: LongRoPE's per-dimension factors, saved as native longrope",
        description="LongRoPE's evolutionary search (population, mutation, crossover, monotonicity constraint, "
        "optional progressive extension) over per-dimension RoPE rescale factors, scored by perplexity at FACTOR x "
        "the trained length; writes a checkpoint whose config.json holds a native longrope rope config, which plain "
        "transformers loads.")
    kinds = p.add_subparsers(dest="search", metavar="WHAT")
    kinds.required = True
    q = kinds.add_parser("longrope", help="per-dimension rescale factors (LongRoPE, Ding et al. 2024)")
    q.add_argument("model", metavar="MODEL", help="hub id, local folder (holding --gguf-file), or reference:NAME")
    q.add_argument("--gguf-file", help="GGUF file name inside MODEL")
    q.add_argument("--factor", type=float, required=True, help="extension factor s > 1 (target = s x trained length)")
    q.add_argument("--out", required=True, help="folder for the log, the result and the checkpoint")
    q.add_argument("--data", help="calibration text (default: the bundled held-out book)")
    q.add_argument("--budget", type=int, default=48, help="candidates to score in all (default 48)")
    q.add_argument("--minutes", type=float, help="also stop after this much wall time")
    q.add_argument("--population", type=int, default=12, help="population size (default 12)")
    q.add_argument("--parents", type=int, default=4, help="parents kept per generation (default 4)")
    q.add_argument("--progressive", action="store_true", help="double the factor from 2 up to --factor, each stage "
                   "seeded by the one before (LongRoPE's progressive extension)")
    q.add_argument("--max-windows", type=int, default=2, help="windows of the target length scored per candidate")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--dtype", default="float32", help="dtype to score in and to save the checkpoint in: float32 (default), bfloat16, float16")
    q.add_argument("--resume", action="store_true", help="continue the search whose log is in --out")
    q.add_argument("--overwrite", action="store_true", help="replace a folder an earlier search wrote")
    q.add_argument("--no-progress", action="store_true", help="no progress bar")
    q.set_defaults(func=run_search)


def _check_apart_from_data(out: Path, data: str | None) -> None:
    """--out and --data apart: the next run would read the search's own files as calibration text (an --out inside a
    --data folder), and a --data inside --out lies where the search writes and --overwrite clears. As eval refuses an
    --output inside its --data folder (evaluation.plan)."""
    if data is None:
        return
    path = Path(data).expanduser()
    if not path.exists():  # a dataset's name: nothing on disk to overlap
        return
    where, folder = Path(os.path.realpath(path)), Path(os.path.realpath(out.expanduser()))  # a link loop: as given
    if where == folder or folder in where.parents:
        raise ValueError(f"--data {data} is inside --out {out}, where the search writes its log and checkpoint (and "
                         "--overwrite clears); keep the calibration text outside --out")
    if where.is_dir() and where in folder.parents:
        raise ValueError(f"--out {out} is inside the --data folder {data}: its log would be read as calibration text "
                         "by the next run (--resume, --overwrite); choose an --out outside it")


def _check_out(out: Path, source: str, resume: bool, overwrite: bool, data: str | None = None) -> None:
    from ..core.outputs import check_replaceable_folder, check_writable_folder
    from ..search.longrope import LOG, is_search_folder, is_search_log

    if resume and overwrite:
        raise ValueError("--resume continues the search in --out, --overwrite replaces it: give one")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; pass a folder")
    if out.is_symlink():  # a folder the search may later replace whole; a link's target is not its to replace
        raise ValueError(f"--out {out} is a link; give the folder's own path")
    check_writable_folder(out, "--out")  # a file on the way: said before the weights load
    source_path = Path(source).expanduser()
    if source_path.exists() and out.resolve() in (source_path.resolve(), *source_path.resolve().parents):
        raise ValueError(f"--out {out} would write into the model it reads ({source}); choose another folder")
    _check_apart_from_data(out, data)
    if resume:
        if not (out / LOG).is_file():
            raise FileNotFoundError(f"--resume: {out / LOG} does not exist; start the search without --resume")
        if not is_search_log(out / LOG):
            raise ValueError(f"--resume: {out / LOG} is not a ctxext search log (its first line is not a search's "
                             "header), so there is nothing to continue; give another --out")
        return
    if out.exists() and any(out.iterdir()):
        if not overwrite and not is_search_folder(out):
            raise FileExistsError(f"--out {out} holds files that are not a ctxext search; ctxext will not replace "
                                  "them: give a new or empty folder")
        if not overwrite:
            raise FileExistsError(f"--out {out} exists; pass --resume to continue its search or --overwrite to "
                                  "replace it")
        check_replaceable_folder(out, "--out", is_ours=is_search_folder, inputs=(source, data),
                                 what="a ctxext search")


def run_search(args) -> int:
    from ..reference import model_source
    from ..core.outputs import OutputLock
    from ..data.sources import check_source
    from ..evaluation.device import resolve_dtype
    from ..evaluation.fingerprint import model_fingerprint
    from ..evaluation.models import load_tokenizer
    from ..loading import load_config, model_skeleton
    from ..search import SearchSettings
    from ..search.longrope import check_search

    settings = SearchSettings(factor=args.factor, budget=args.budget, minutes=args.minutes,
                              population=args.population, parents=args.parents, progressive=args.progressive,
                              seed=args.seed)
    source = model_source(args.model)
    out = Path(args.out)
    _check_out(out, source, args.resume, args.overwrite, args.data)
    check_source(source, gguf_file=args.gguf_file, what="MODEL")
    dtype = resolve_dtype(args.dtype)
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = load_tokenizer(source, **kwargs)
    tokens, data_label = _calibration_tokens(tokenizer, args.data)
    _check_unpatched(args.model, load_config(source, **kwargs))
    check_search(model_skeleton(source, **kwargs), tokens, settings, args.max_windows)  # before the weights load
    describe = {"model": args.model, "gguf_file": args.gguf_file, "data": data_label, "dtype": args.dtype,
                "model_files": model_fingerprint({"model": source, "gguf_file": args.gguf_file}),
                "data_sha256": hashlib.sha256(tokens.numpy().tobytes()).hexdigest()}  # the text scored, as tokens
    with OutputLock(out, "--out"):  # one writer, from before the load to the checkpoint's move into place
        # again: another run may have written it meanwhile
        _check_out(out, source, args.resume, args.overwrite, args.data)
        result = _search_into(args, out, source, dtype, kwargs, tokens, settings, tokenizer, describe)
    print(format_result(result, out))
    return 0


def _check_unpatched(model: str, config) -> None:
    """A folder saved from a ctxext-patched model (or exported natively) loads patched; the search starts from the
    model's own positions, so it is refused here, before the weights load."""
    from ..core.errors import PatchError
    from ..core.spec import CONFIG_KEY

    saved = getattr(config, CONFIG_KEY, None)
    if isinstance(saved, dict):
        raise PatchError(f"MODEL {model} was saved from a model patched by ctxext ({saved.get('method')} x"
                         f"{saved.get('factor')}); the search starts from the unpatched model: give the model it was "
                         "made from")


def _search_into(args, out: Path, source: str, dtype, kwargs, tokens, settings, tokenizer, describe) -> dict:
    """Run the search into ``out``. With ``--overwrite`` and an earlier search there, the new one runs in a folder
    beside ``out`` that replaces it only once its checkpoint is complete: a failed or interrupted run leaves the
    earlier result as it was."""
    from ..core.outputs import staged_folder
    from ..loading import from_pretrained
    from ..search import longrope_search
    from ..search.longrope import SearchIncomplete

    model = from_pretrained(source, dtype=dtype, **kwargs).eval()
    replace = args.overwrite and out.exists() and any(out.iterdir())
    if not replace:
        out.mkdir(parents=True, exist_ok=True)
        return longrope_search(model, tokens, settings, out, tokenizer=tokenizer, max_windows=args.max_windows,
                               resume=args.resume, progress=not args.no_progress, describe=describe)
    try:
        with staged_folder(out) as staging:
            return longrope_search(model, tokens, settings, staging, tokenizer=tokenizer,
                                   max_windows=args.max_windows, resume=False, progress=not args.no_progress,
                                   describe=describe)
    except SearchIncomplete as exc:
        raise SearchIncomplete(f"{exc.reason}; --out {out} still holds the earlier search, unchanged") from None


def _calibration_tokens(tokenizer, data: str | None):
    import torch

    from ..evaluation.data import load_texts, tokenize_texts

    if data is None:
        from ..reference import reference_text

        texts, label = [reference_text()], "reference (held-out emma)"
    else:
        texts, label = load_texts(data).texts, data
    docs = tokenize_texts(tokenizer, texts)
    return torch.cat(docs), label


def format_result(result: dict, out: Path) -> str:
    stage = result["stage"]
    starts = ", ".join(f"{name} {value:.3f}" for name, value in sorted(result["starts"].items(), key=lambda x: x[1]))
    settings = result.get("settings") or {}
    stopped = result.get("stopped") or ("minutes" if result.get("out_of_time") else "budget")
    why = {"minutes": f"stopped by --minutes {settings.get('minutes')}",
           "exhausted": f"stopped with budget left: the search space is exhausted ({result.get('exhausted')})",
           }.get(stopped, f"--budget {settings.get('budget')} spent")
    lines = [
        f"longrope x{stage:g} ({result['target_length']} tokens): best perplexity {result['best_score']:.3f} after "
        f"{result['scored']} candidates ({result['fresh']} scored now); {why}",
        f"starting points at x{stage:g}: {starts}",
        f"checkpoint: {out} (plain transformers.AutoModelForCausalLM.from_pretrained loads it as rope type longrope)",
    ]
    return "\n".join(lines)


__all__ = ["register", "run_search"]
