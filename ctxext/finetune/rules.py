"""The recipe rules pydantic's types cannot say: what must exist on disk, and what one section asks of another.

Each function returns the problems it finds (each naming its key path); the recipe's validators (``schema``) raise
them. The rules that read the disk run when a recipe is read (``recipe_from_dict`` passes the recipe's file as the
validation context), not when a section is built in code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import reference
from .errors import RecipeError

REFERENCE_PREFIX = "reference:"
#: patch methods that take positions out of the model's input: PoSE, which trains through the position ids, has
#: nothing to act on (NoPE has no positions; the ALiBi swap biases attention by the tokens' distance in the sequence)
NO_POSITION_INPUT = {"alibi": "the ALiBi swap biases attention by distance in the sequence, not by position ids",
                     "nope": "NoPE removes the positional encoding"}


def is_shipped(item: str) -> bool:
    return isinstance(item, str) and item.startswith(REFERENCE_PREFIX)


def shipped_files(item: str, key: str) -> list[Path]:
    """``reference:train`` / ``reference:emma`` -> the xz-compressed text files shipped with ctxext."""
    try:
        return reference.data_files(item[len(REFERENCE_PREFIX):])
    except ValueError:
        raise RecipeError(f"{key}: unknown shipped text {item!r}; choose one of "
                          + ", ".join(f"{REFERENCE_PREFIX}{n} = {what}" for n, what in reference.DATA_NAMES.items())
                          ) from None
    except FileNotFoundError as exc:
        raise RecipeError(f"{key}: {exc}") from None


def base_dir(source: str | None) -> Path:
    """The folder relative data paths are read from: the recipe file's folder, else the working directory."""
    return Path(source).resolve().parent if source else Path.cwd()


def resolve(item: str, source: str | None) -> Path:
    p = Path(item).expanduser()
    return p if p.is_absolute() else base_dir(source) / p


def data_paths(items: list[str], key: str, source: str | None) -> list[Path]:
    """Paths of data entries: ``reference:NAME`` -> the shipped files, anything else -> :func:`resolve`."""
    paths: list[Path] = []
    for item in items:
        paths.extend(shipped_files(item, key) if is_shipped(item) else [resolve(item, source)])
    return paths


def listed(value) -> list[str]:
    """A key that takes one name or a list of them, as a list of strings (null: none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _where(source: str | None, item: str) -> str:
    if Path(item).expanduser().is_absolute():
        return ""
    return f" (relative paths are read from {'the recipe folder ' if source else ''}{base_dir(source)})"


def empty_path(key: str, source: str | None) -> str:
    folder = "the recipe folder" if source else "the working directory"
    return f"{key}: an empty path (it would name {folder}, read as a whole); remove it or give a file or folder"


def missing_data(item: str, key: str, source: str | None) -> str | None:
    """Why a data.files / eval.data entry cannot be read (None: it can)."""
    try:
        found = data_paths([item], key, source)
    except RecipeError as exc:
        return str(exc)
    if all(q.exists() for q in found):
        return None
    hint = " (use 'reference' for the held-out book)" if key == "eval.data" else ""
    return f"{key}: {item!r} not found{_where(source, item)}{hint}"


def expand_files(paths: list[Path], exclude: list[str]) -> list[Path]:
    """A recipe's data files, found as evaluation finds them (``textfiles.select_files``)."""
    from ..data.textfiles import select_files

    try:
        return select_files(paths, exclude, exclude_key="data.exclude")
    except ValueError as exc:
        raise RecipeError(f"data.files: {exc}") from None


def check_model_sources(m, err, hub: bool = False) -> None:
    """model.name / model.tokenizer must be loadable: local folders (or what looks like a path) when the recipe is
    read, hub ids (``hub``: when the run starts, so --check works offline) only then."""
    from ..data.sources import _looks_like_path, check_source

    for key, name, gguf in (("model.name", m.name, m.gguf_file), ("model.tokenizer", m.tokenizer, None)):
        if not name or reference.reference_name(name) is not None:
            continue
        if hub == (_looks_like_path(name) or Path(name).expanduser().exists()):
            continue  # a path is checked with the recipe, a hub id when the run starts: each once
        try:
            check_source(name, gguf_file=gguf, revision=m.revision, what=key)
        except (ValueError, OSError) as exc:
            err(str(exc), key)


def model_problems(m) -> list[str]:
    if not m.name:
        return ["model.name is required (a hub id, a local directory, or reference:llama)"]
    if reference.reference_name(m.name) is not None:
        try:
            reference.model_source(m.name)
        except (ValueError, FileNotFoundError) as exc:
            return [f"model.name {m.name!r}: {exc}"]
        return []
    problems: list[str] = []
    check_model_sources(m, lambda message, key=None: problems.append(message))
    return problems


def output_problems(o) -> list[str]:
    if not o.dir:
        return ["output.dir is required (the folder for the adapter, checkpoints and log)"]
    out = Path(o.dir).expanduser()
    if out.exists() and not out.is_dir():
        return [f"output.dir: {o.dir!r} is a file, not a folder"]
    parent = next((q for q in out.absolute().parents if q.exists()), None)
    if not out.exists() and parent is not None and not parent.is_dir():
        return [f"output.dir: {o.dir!r} cannot be made: {str(parent)!r} is a file"]
    return []


def apart_problems(o, m, d, e, source: str | None) -> list[str]:
    """output.dir holds none of what the run reads (--overwrite clears the folder: a base model kept in it, say an
    earlier run's merged/, would go), and lies in no data.files folder (the run's log and checkpoints would be read as
    training data by the next run)."""
    out = Path(o.dir).expanduser().resolve()
    reads = [("model.name", m.name if m else None), ("model.tokenizer", m.tokenizer if m else None)]
    reads += [("data.files", f) for f in (d.files if d else []) if not is_shipped(f)]
    if e is not None and e.enabled:
        reads += [("eval.data", f) for f in listed(e.data) if f != "reference" and not is_shipped(f)]
    problems = []
    for key, item in reads:
        if not item or reference.reference_name(item) is not None:
            continue
        path = (Path(item).expanduser() if key.startswith("model") else resolve(item, source)).resolve()
        if not path.exists():
            continue
        if path == out or out in path.parents:
            problems.append(f"output.dir {o.dir!r} holds {key} {item!r}: a run writes there and --overwrite clears "
                            "it; choose an output.dir apart from what the run reads")
        elif key == "data.files" and path.is_dir() and path in out.parents:
            problems.append(f"output.dir {o.dir!r} is inside the data.files folder {item!r}: the run's log and "
                            "checkpoints would be read as training data by the next run; choose an output.dir "
                            "outside it")
    return problems


def data_problems(d, source: str | None, on_disk: bool) -> list[str]:
    """data: something to read; the files (each found, checked by its own validator) not all excluded."""
    if not d.files and not d.dataset:
        return ["data: give data.files (text/JSONL files or folders, or reference:train) or data.dataset "
                "(a datasets name)"]
    if on_disk and d.files:
        try:
            expand_files(data_paths(d.files, "data.files", source), d.exclude)
        except RecipeError as exc:
            return [str(exc)]
    return []


def eval_problems(data: Any, source: str | None) -> list[str]:
    items = listed(data)
    if not items:
        return ["eval.data is empty; use reference (the held-out book) or files, or set eval.enabled: false"]
    if any(not f.strip() for f in items):
        return [empty_path("eval.data", source)]
    return [why for f in items if f != "reference" and (why := missing_data(f, "eval.data", source))]


def train_problems(t, d, p) -> list[str]:
    """What train asks of data and patch: the batch against data.max_sequences, PoSE's window and target, S²-Attn's
    groups and patch method. A section that did not validate (None) is left out of the rules that read it. The target
    against the patched model's length is checked with the architecture."""
    from ..attention.shifted_sparse import check_shift_attention
    from ..core.errors import PatchError

    problems = []
    seq_length, method = (d.seq_length if d else None), (p.method if p else None)
    if d is not None and d.max_sequences is not None and t.batch_size > d.max_sequences:
        problems.append(f"train.batch_size ({t.batch_size}) is larger than data.max_sequences ({d.max_sequences}), "
                        "the most packed sequences the run keeps: one optimizer step would repeat sequences; lower "
                        "train.batch_size or raise data.max_sequences")
    if t.pose is not None:
        problems += _pose_problems(t.pose, seq_length, p)
    if t.shift_attention:
        try:
            check_shift_attention(seq_length, t.shift_group_ratio, method)
        except PatchError as exc:
            problems.append(f"train.shift_attention: {exc}")
    return problems


def _pose_problems(pose, seq_length: int | None, p) -> list[str]:
    problems = []
    if pose.target_length is not None:
        if seq_length is not None and seq_length >= pose.target_length:
            problems.append(f"train.pose.target_length ({pose.target_length}) must be longer than data.seq_length "
                            f"({seq_length}), the window PoSE trains on")
    elif p is not None and p.method is None:
        problems.append("train.pose.target_length is required without a patch (by default it is the patched length)")
    if seq_length is not None and seq_length < pose.chunks:
        problems.append(f"data.seq_length ({seq_length}) must be at least train.pose.chunks ({pose.chunks})")
    method = ((p.method if p else None) or "").strip().lower()
    if method in NO_POSITION_INPUT:
        problems.append(f"train.pose: PoSE trains through the position ids, and patch.method {p.method!r} takes them "
                        f"out of the model's input ({NO_POSITION_INPUT[method]}); drop train.pose or use a rotary "
                        "patch (pi, yarn, ...)")
    return problems
