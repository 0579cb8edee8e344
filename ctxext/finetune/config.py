"""Recipes: YAML files read into the pydantic models of ``schema``, validated before anything is loaded or trained.

Every problem is reported at once, one line per key path (``train.lr: ...``): :func:`problems_of` reads pydantic's
``ValidationError.errors()``; the rules between keys are validators in ``schema``, so pydantic reports them beside
the type errors. ``--set a.b=value`` overrides any key (the value is read as YAML: ``4``, ``2e-4``,
``[q_proj, v_proj]``, ``null``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import RecipeError, one_line, raise_problems, short
from .rules import check_model_sources, expand_files, is_shipped  # noqa: F401 - re-exported
from .schema import (SECTIONS, DataConfig, EvalConfig, LoraConfig, ModelConfig, OutputConfig,  # noqa: F401
                     PatchConfig, PoseConfig, Recipe, TrainConfig)

NOT_A_NAME = "is not a name (YAML reads on, off, yes, no, true, false and numbers as values): quote it or correct it"


def _walk(loc: tuple) -> tuple[list[str], type[BaseModel] | None]:
    """The key path of a pydantic error location (list indices as ``[i]``; the union branches pydantic names on the
    way left out), and the section model it ends in."""
    path, cls = [], Recipe
    for part in loc:
        fields = cls.model_fields if cls is not None else {}
        if isinstance(part, str) and part in fields:
            path.append(part)
            annotation = fields[part].annotation
            cls = next((a for a in (annotation, *getattr(annotation, "__args__", ())) if isinstance(a, type)
                        and issubclass(a, BaseModel)), None)
        elif isinstance(part, int) and path:
            path[-1] += f"[{part}]"
    return path, cls


def problems_of(exc: ValidationError) -> list[str]:
    """One line per key path; unknown keys gathered per section with what it accepts; a rule's problems as it
    says them."""
    lines, said, unknown = [], set(), {}
    for err in exc.errors():
        kind, loc = err["type"], err["loc"]
        if kind == "recipe":
            lines.extend(err["ctx"]["problems"])
        elif kind in ("extra_forbidden", "invalid_key"):
            path, cls = _walk(loc[:-1])
            where = ".".join(path)
            if kind == "extra_forbidden":
                unknown.setdefault(where, (cls, []))[1].append(str(loc[-1]))
            else:
                name = f"{where}.{err['input']}" if where else str(err["input"])
                lines.append(f"{'key' if where else 'section'} {name!r} {NOT_A_NAME}")
        else:
            key = ".".join(_walk(loc)[0])
            if key.split("[")[0] in said:  # one line per key: a union's branches, a list's items each fail
                continue
            said.add(key.split("[")[0])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {msg[:1].lower() + msg[1:]}, got {short(err.get('input'))}")
    for where, (cls, keys) in unknown.items():
        listed = ", ".join(f"{where}.{k}" if where else k for k in keys)
        lines.append(f"unknown {'key' if where else 'section'}(s) {listed}; {where or 'a recipe'} accepts: "
                     f"{', '.join(cls.model_fields)}")
    return lines


def recipe_from_dict(data: Any, source: str | None = None, problems: list[str] | None = None) -> Recipe:
    """Build and validate a recipe; every problem (with any already in ``problems``) is reported at once in one
    :class:`RecipeError`."""
    if not isinstance(data, dict):
        kind = "nothing" if data is None else f"a {_yaml_kind(data)} ({short(data)})"
        raise RecipeError(f"a recipe must be a mapping with sections {', '.join(SECTIONS)} "
                          f"(e.g. 'model:' then '  name: reference:llama'), got {kind}")
    problems = list(problems or [])
    data = {**{k: {} for k in SECTIONS}, **{k: ({} if v is None and k in SECTIONS else v) for k, v in data.items()}}
    try:  # the context turns on the rules that read the disk (relative paths from the recipe's folder)
        recipe = Recipe.model_validate(data, context={"source": source})
    except ValidationError as exc:
        problems += problems_of(exc)
    raise_problems(problems)
    recipe._source = source
    return recipe


def _yaml_kind(value: Any) -> str:
    kinds = ((list, "list"), (str, "string"), (bool, "true/false"), ((int, float), "number"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


#: keys whose values are paths the recipe reads; given with --set they are relative to the working directory
_PATH_KEYS = {("data", "files"), ("eval", "data")}


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=value`` -> (["a", "b"], value read as YAML)."""
    if "=" not in text:
        raise RecipeError(f"--set expects KEY=VALUE (e.g. train.steps=100), got {text!r}")
    key, raw = text.split("=", 1)
    path = [p.strip() for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in path):
        raise RecipeError(f"--set {text}: bad key {key.strip()!r}; a key is SECTION.NAME (e.g. train.steps=100)")
    if len(path) == 1:
        raise RecipeError(f"--set {text}: {key.strip()!r} is a whole section; set one key, SECTION.NAME=VALUE "
                          f"(e.g. {key.strip()}.{_first_key(key.strip())}=...)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return path, value


def _first_key(section: str) -> str:
    fields = getattr(SECTIONS[section].annotation, "model_fields", {}) if section in SECTIONS else {}
    return next(iter(fields), "key")


def _absolute_from_cwd(value: Any) -> Any:
    """A --set path value (or list of them) made absolute against the working directory."""
    def fix(v):
        if (isinstance(v, str) and v and v != "reference" and not is_shipped(v)
                and not Path(v).expanduser().is_absolute()):
            return str(Path.cwd() / Path(v).expanduser())
        return v

    if isinstance(value, list):
        return [fix(v) for v in value]
    return fix(value)


def apply_overrides(data: dict, overrides: list[str], problems: list[str] | None = None) -> dict:
    """Apply ``--set KEY=VALUE`` overrides. Bad ones go to ``problems`` when given (the others still apply);
    without it, every bad one is reported at once in a RecipeError."""
    data = dict(data or {})
    own = problems is None
    problems = [] if own else problems
    for text in overrides:
        try:
            path, value = parse_override(text)
        except RecipeError as exc:
            problems.append(str(exc))
            continue
        if path[0] not in SECTIONS:
            problems.append(f"--set {text}: unknown section {path[0]!r}; a recipe has: {', '.join(SECTIONS)}")
            continue
        if tuple(path) in _PATH_KEYS:
            value = _absolute_from_cwd(value)
        node = data
        for i, key in enumerate(path[:-1]):
            child = node.get(key)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                problems.append(f"--set {text}: {'.'.join(path[: i + 1])} is not a section")
                break
            child = dict(child)
            node[key] = child
            node = child
        else:
            node[path[-1]] = value
    if own:
        raise_problems(problems)
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""


def _construct_mapping(loader, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        try:
            key = loader.construct_object(key_node, deep=True)
            hash(key)
        except Exception:  # noqa: BLE001 - let the normal constructor report odd keys
            continue
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (first on line {seen[key] + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error(path: Path, exc: yaml.YAMLError) -> str:
    """``FILE:LINE: problem`` from a YAML error (line numbers from 1)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
    text = f"{where}: {problem}"
    if context and context != problem:
        text += f" ({context}" + (f" at line {exc.context_mark.line + 1}" if getattr(exc, "context_mark", None)
                                  and exc.context_mark.line != getattr(mark, "line", None) else "") + ")"
    hints = ("block end", "block mapping", "mapping values are not allowed", "could not find expected ':'")
    if any(w in text for w in hints):
        text += "; check the indentation and that each key is followed by ': '"
    return one_line(text + "; not valid YAML")


def read_recipe_file(path: str | Path) -> dict:
    """The recipe file as a mapping; a missing, unreadable, empty, non-YAML or non-mapping file is a RecipeError."""
    path = Path(path)
    if not path.exists():
        raise RecipeError(f"recipe {str(path)!r} not found")
    if path.is_dir():
        raise RecipeError(f"recipe {str(path)!r} is a folder; give a recipe YAML file "
                          "(e.g. recipes/tiny/llama_pi_lora.yaml)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"recipe {path}: not UTF-8 text (byte {exc.start}); a recipe is a YAML file") from None
    except OSError as exc:
        raise RecipeError(f"recipe {path}: cannot read ({exc.strerror or exc})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise RecipeError(_yaml_error(path, exc)) from None
    if data is None:
        raise RecipeError(f"recipe {path} is empty; a recipe is a mapping with sections {', '.join(SECTIONS)}")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: a recipe must be a mapping with sections {', '.join(SECTIONS)}, got a "
                          f"{_yaml_kind(data)} ({short(data)})")
    return data


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``--set`` overrides, and validate it (no model or data is loaded). Every problem
    found (unknown keys, wrong types, bad values, missing files, bad overrides) is reported in one RecipeError."""
    path = Path(path)
    data = read_recipe_file(path)
    problems: list[str] = []
    try:
        data = apply_overrides(data, list(overrides), problems)
        return recipe_from_dict(data, source=str(path), problems=problems)
    except RecipeError as exc:
        raise RecipeError(f"recipe {path}: {exc}", exc.problems) from None

