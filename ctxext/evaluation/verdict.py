"""One plain sentence per model, computed from a run's rows: does the unpatched model hold past its trained
length, and which method holds best.

Everything is read against the unpatched model at its trained length (1x): ``x3.4`` means 3.4 times that
perplexity. Last-quarter perplexity is used where the rows have it (it scores only targets far into each window,
where position matters), plain perplexity otherwise.

Perplexity rewards a model that ignores far context, so where passkey or RULER-style tasks ran the verdict also
names the method that retrieves best at the headline length (4x), and every method that holds perplexity there
but does not retrieve.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .requests import NONE, is_unpatched_label

#: Perplexity ratios (vs unpatched at 1x) from which the unpatched model "fails" / "degrades".
FAILS = 2.0
DEGRADES = 1.3
#: The multiple of the trained length a verdict is stated at, when the run has it (else its longest length).
HEADLINE_MULTIPLE = 4
#: Task accuracy below which a method "does not retrieve"; and the unpatched accuracy at the trained length from
#: which retrieval can rank methods at all (a model that cannot retrieve at 1x tells nothing by failing at 4x).
NO_RETRIEVAL = 0.2
RETRIEVES_AT_1X = 0.5


def _headline(lengths: list[int], trained: int) -> int | None:
    longer = sorted(n for n in lengths if n > trained)
    if not longer:
        return None
    return trained * HEADLINE_MULTIPLE if trained * HEADLINE_MULTIPLE in longer else longer[-1]


def _metric(rows) -> str:
    return "ppl_last_quarter" if any(r.get("ppl_last_quarter") is not None for r in rows) else "ppl"


def _multiple(length: int, trained: int) -> str:
    m = length / trained
    return f"{m:g}x"


def _perplexity_verdict(label: str, rows: list[dict[str, Any]], trained: int) -> str | None:
    field = _metric(rows)
    what = "last-quarter perplexity" if field == "ppl_last_quarter" else "perplexity"
    value = {(r["label"], int(r["length"])): r.get(field) for r in rows if not r.get("not_applicable")}
    cannot = {(r["label"], int(r["length"])) for r in rows if r.get("not_applicable")}
    base = value.get(("none", trained))
    if base is None or base <= 0:
        return None
    longer = sorted({int(r["length"]) for r in rows if int(r["length"]) > trained})
    headline = _headline(longer, trained)
    if headline is None:
        return None
    at = f"at {headline} = {_multiple(headline, trained)}"

    parts = []
    unpatched_cannot = [n for n in longer if ("none", n) in cannot]
    if unpatched_cannot:
        parts.append(f"unpatched cannot run past {max([trained] + [n for n in longer if n < unpatched_cannot[0]])} "
                     "positions")
    else:
        ratios = {n: value[("none", n)] / base for n in longer if value.get(("none", n)) is not None}
        if headline in ratios:
            r = ratios[headline]
            first_fail = next((n for n in sorted(ratios) if ratios[n] >= FAILS), None)
            if first_fail is not None and r >= FAILS:
                before = max([trained] + [n for n in longer if n < first_fail])
                parts.append(f"unpatched fails past {before} ({what} x{r:.1f} {at})")
            elif r >= DEGRADES:
                parts.append(f"unpatched degrades ({what} x{r:.1f} {at})")
            else:
                parts.append(f"unpatched holds (x{r:.2f} {at}, x{ratios[longer[-1]]:.2f} at {longer[-1]})"
                             if longer[-1] in ratios else f"unpatched holds (x{r:.2f} {at})")

    patched = {lab: v for (lab, n), v in value.items() if n == headline and lab != "none" and v is not None}
    if patched:
        best = min(patched, key=patched.get)
        r = patched[best] / base
        unpatched_here = value.get(("none", headline))
        if unpatched_here is not None and patched[best] >= unpatched_here:
            parts.append(f"no method beats unpatched {at} (best: {best} x{r:.2f})")
        else:
            holds = "holds" if r < DEGRADES else "is best"
            parts.append(f"{best} {holds} (x{r:.2f} {at})")
    if not parts:
        return None
    return f"{label}: " + "; ".join(parts)


def _passkey_verdict(rows: list[dict[str, Any]], ppl_rows: list[dict[str, Any]], trained: int) -> Retrieval:
    """As for the RULER-style tasks: the best method at the headline length, and any that holds perplexity there
    but does not retrieve the key."""
    acc = {(r["label"], int(r["length"])): r["accuracy"] for r in rows if r.get("accuracy") is not None}
    return _retrieval_sentence(acc, "passkey", "passkey", ppl_rows, trained)


def _retrieval_verdict(rows: list[dict[str, Any]], ppl_rows: list[dict[str, Any]], trained: int) -> Retrieval:
    """Which method retrieves best at the headline length, and which hold perplexity there but do not retrieve."""
    from .task_rows import task_average, task_names

    tasks = task_names(rows)
    if not tasks:
        return None, []
    if len(tasks) > 1:
        scored, what = task_average(rows), f"average of {len(tasks)} tasks"
    else:
        scored, what = [r for r in rows if r.get("accuracy") is not None], tasks[0]
    acc = {(r["label"], int(r["length"])): r["accuracy"] for r in scored}
    return _retrieval_sentence(acc, f"retrieval ({what})", what, ppl_rows, trained)


#: A retrieval measure's sentence, and the methods that hold perplexity but miss there, each as
#: (label, "at N = Mx", perplexity ratio, accuracy, the measure's short name)
Retrieval = tuple[Optional[str], list[tuple[str, str, float, float, str]]]


def _retrieval_sentence(acc: dict[tuple[str, int], float], what: str, short: str, ppl_rows: list[dict[str, Any]],
                        trained: int) -> Retrieval:
    """``acc`` maps (label, length) to accuracy; ``what`` names the measure at the start of the sentence, ``short``
    where a miss is listed beside another measure's."""
    if not acc:
        return None, []
    headline = _headline(sorted({n for _, n in acc}), trained)
    if headline is None:
        return None, []
    at = f"at {headline} = {_multiple(headline, trained)}"
    parts = []
    base = acc.get(("none", trained))
    if base is not None and base < RETRIEVES_AT_1X:
        return (f"{what}: unpatched scores {100 * base:.0f}% even at its trained length {trained}, "
                "too little to rank methods by"), []
    if ("none", headline) in acc:
        parts.append(f"unpatched {_percent(acc[('none', headline)])}"
                     + (f" ({_percent(base)} at {trained})" if base is not None else ""))
    patched = {lab: a for (lab, n), a in acc.items() if n == headline and lab != "none"}
    if patched:
        best = max(patched, key=patched.get)
        parts.append(f"best {best} {_percent(patched[best])}" if patched[best] > 0 else "no method retrieves")
    sentence = f"{what} {at}: " + ", ".join(parts) if parts else None
    field = _metric(ppl_rows)
    ppl = {(r["label"], int(r["length"])): r.get(field) for r in ppl_rows if not r.get("not_applicable")}
    ppl_base = ppl.get(("none", trained))
    # A miss says something only about a model that can retrieve: shown by its unpatched row at the trained length
    # or, where the run has none (a task may not fit there), by any row of the run that retrieves.
    can_retrieve = base is not None or any(a >= RETRIEVES_AT_1X for a in acc.values())
    misses = []
    if ppl_base and can_retrieve:  # perplexity that holds while retrieval is gone
        misses = [(lab, at, ppl[(lab, headline)] / ppl_base, a, short) for lab, a in sorted(patched.items())
                  if a < NO_RETRIEVAL and ppl.get((lab, headline)) and ppl[(lab, headline)] / ppl_base < DEGRADES]
    return sentence, misses


def _misses_sentence(misses: list[tuple[str, str, float, float, str]], labelled: bool) -> list[str]:
    """One clause per method and length that holds perplexity but misses: passkey's and the tasks' misses of one
    method are named together ("retrieves 10% (passkey), 0% (niah)"), not as two clauses. ``labelled`` (both
    measures ran): every score names its measure, as the clauses follow both sentences."""
    grouped: dict[tuple[str, str], list[tuple[float, float, str]]] = {}
    for lab, at, ratio, a, short in misses:
        grouped.setdefault((lab, at), []).append((ratio, a, short))
    clauses = []
    for (lab, at), found in grouped.items():
        scores = (_percent(found[0][1]) if len(found) == 1 and not labelled
                  else ", ".join(f"{_percent(a)} ({short})" for _, a, short in found))
        clauses.append(f"{lab} holds perplexity (x{found[0][0]:.2f}) but retrieves {scores} {at}")
    return clauses


def _percent(accuracy: float) -> str:
    """An accuracy as a whole percentage; one that rounds to 0 but is not 0 reads "<1%", not "0%"."""
    return "<1%" if 0 < accuracy < 0.005 else f"{100 * accuracy:.0f}%"


def verdicts(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence per model that has an unpatched row at its trained length and longer rows."""
    out = []
    for model in models:
        trained = model.get("original_length")
        if not trained:
            continue
        # the unpatched row of a model with a LoRA adapter ("none +LoRA") is its unpatched row
        mine = [dict(r, label=NONE) if is_unpatched_label(str(r.get("label"))) else r
                for r in rows if r.get("model") == model["label"]]
        sentence = _perplexity_verdict(model["label"], [r for r in mine if r.get("kind", "ppl") == "ppl"], int(trained))
        passkey, passkey_misses = _passkey_verdict([r for r in mine if r.get("kind") == "passkey"],
                                                   [r for r in mine if r.get("kind", "ppl") == "ppl"], int(trained))
        retrieval, task_misses = _retrieval_verdict([r for r in mine if r.get("kind") not in ("ppl", "passkey")],
                                                    [r for r in mine if r.get("kind", "ppl") == "ppl"], int(trained))
        both = passkey is not None and retrieval is not None
        for extra in (passkey, retrieval, *_misses_sentence(passkey_misses + task_misses, labelled=both)):
            if extra and sentence:
                sentence += f"; {extra}"
            elif extra:
                sentence = f"{model['label']}: {extra}"
        if sentence:
            out.append(sentence)
        elif mine:
            out.append(f"{model['label']}: no verdict: {_no_verdict_reason(mine, int(trained))}")
    return out


def _no_verdict_reason(rows: list[dict[str, Any]], trained: int) -> str:
    """Why a model's rows give no sentence: a verdict compares lengths past the trained one with the unpatched
    model at the trained length."""
    if not any(int(r["length"]) > trained for r in rows):
        return f"no length past the trained {trained}"
    if not any(r.get("label") == NONE and int(r["length"]) == trained for r in rows):
        return f"no unpatched row at the trained length {trained} (measure method none there)"
    return f"no row past the trained {trained} gives a number to compare"


def format_verdicts(rows: Sequence[dict[str, Any]], models: Sequence[dict[str, Any]]) -> str:
    lines = verdicts(rows, models)
    if not lines:
        return ""
    return "\n".join(["verdict (x = times the unpatched model's value at its trained length):"] + [f"  {s}" for s in lines])
