"""What ``--tasks`` takes: ``ppl``, ``passkey``, the RULER-style task names, and aliases for groups of them."""

from __future__ import annotations

from .ruler import TASKS

#: Measures that are not RULER tasks.
PPL = "ppl"
PASSKEY = "passkey"
ALIASES: dict[str, tuple[str, ...]] = {
    "ruler": tuple(TASKS),
    "niah": tuple(n for n in TASKS if n.startswith("niah_")),
    "quick": ("niah_single_1", "niah_single_2", "niah_multikey_1", "vt"),
}
NOT_OFFERED = {
    "qa_1": "RULER's QA tasks need SQuAD / HotpotQA, which are not offline; run them with `ctxext lm-eval`",
    "qa_2": "RULER's QA tasks need SQuAD / HotpotQA, which are not offline; run them with `ctxext lm-eval`",
}


def parse_tasks(text: str) -> list[str]:
    """The measures named in ``text`` (comma-separated names and aliases), in order, each once.

    Raises ValueError naming every unknown name and what is known."""
    out: list[str] = []
    unknown = []
    for part in text.split(","):
        name = part.strip().lower().replace("-", "_")
        if not name:
            continue
        if name in ALIASES:
            names = list(ALIASES[name])
        elif name in TASKS or name in (PPL, PASSKEY):
            names = [name]
        elif name in NOT_OFFERED:
            raise ValueError(f"--tasks {part.strip()}: {NOT_OFFERED[name]}")
        else:
            unknown.append(part.strip())
            continue
        out.extend(n for n in names if n not in out)
    if unknown:
        raise ValueError(f"--tasks: unknown task(s) {', '.join(repr(u) for u in unknown)}; known: {known()}")
    if not out:
        raise ValueError(f"--tasks: no task given; known: {known()}")
    return out


def known() -> str:
    aliases = ", ".join(f"{a} ({len(v)} tasks)" for a, v in ALIASES.items())
    return f"{PPL}, {PASSKEY}, {', '.join(TASKS)}; aliases {aliases}"


def is_task(kind: str) -> bool:
    """Whether a result row's kind is a RULER-style task."""
    return kind in TASKS
