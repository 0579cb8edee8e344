"""LongRoPE's evolutionary search over per-dimension rescale factors (Ding et al. 2024, Section 3.2 and Algorithm 1;
microsoft/LongRoPE's ``evolution/``), scored by a caller's function (perplexity at the target length).

- **Population.** The starting candidates (PI, YaRN and NTK factors at the stage's factor; at a later stage of a
  progressive search also the previous stage's best, scaled to the new factor) are scored first, then mutations of
  them fill the population.
- **Each generation** keeps the best ``parents`` and makes as many children as the population holds: half by mutation
  (each factor multiplied by a log-normal step with probability ``mutation_rate``), half by crossover (each factor
  from one of two parents), each one not evaluated at this stage before; the population is the best of parents and
  children.
- **Monotonicity constraint**: every candidate is projected onto it (factors >= 1, non-decreasing in the frequency
  index, at most twice the stage's factor) instead of being discarded, as LongRoPE does with its invalid ones.
- **Convergence**: a generation that makes nothing new (every child evaluated before) is followed by
  generations with wider steps (mutation rate and scale doubled at each, then random candidates over the whole
  constrained space) until one finds an unseen candidate; then the step returns to its own size. A stage thus ends
  only when its budget is spent, the clock runs out, or every candidate has been scored (``stopped`` in the result).
- **Progressive extension** (``progressive``): the factor doubles from 2 to the target, each stage seeded by the one
  before, as LongRoPE reaches 256k from 128k.
- **Budget**: ``budget`` scored candidates in all (split between the stages), and optionally ``minutes`` of wall
  time. Candidates are rounded to 4 decimals, so what is logged is exactly what was scored.
- **Resumable**: every score goes to a JSON-lines log as it is made. The search is deterministic given its seed and the
  scores, so a resumed run replays the same candidates and takes their scores from the log instead of re-scoring; a
  larger budget continues where the log ends. The log's rows are checked when read (a row that is not a score the
  search wrote, a NaN or negative score say, is left out and its candidate scored again), and its header against the
  settings that change scores.

The best candidate of the final stage is never worse than its starting points: they are scored and kept.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.outputs import write_atomic
from .longrope_factors import monotone

DECIMALS = 4


@dataclass(frozen=True)
class SearchSettings:
    factor: float
    budget: int = 48
    minutes: float | None = None
    population: int = 12
    parents: int = 4
    mutation_rate: float = 0.3
    mutation_scale: float = 0.1
    progressive: bool = False
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor) and self.factor > 1):
            raise ValueError(f"the search needs a factor > 1, got {self.factor!r}")
        if self.budget < 1:
            raise ValueError(f"--budget must be at least 1 scored candidate, got {self.budget}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"--minutes must be > 0, got {self.minutes}")
        if self.population < 2 or not 1 <= self.parents <= self.population:
            raise ValueError(f"--population must be >= 2 and --parents between 1 and it, got {self.population}, "
                             f"{self.parents}")
        if not 0 < self.mutation_rate <= 1 or not self.mutation_scale > 0:
            raise ValueError("mutation_rate must be in (0, 1] and mutation_scale > 0")

    def stages(self) -> list[float]:
        if not self.progressive:
            return [float(self.factor)]
        out, f = [], 2.0
        while f < self.factor:
            out.append(f)
            f *= 2
        return out + [float(self.factor)]


def _key(stage: float, factors: list[float]) -> str:
    return json.dumps([round(stage, 6), factors])


#: How ``ctxext search longrope`` spells the settings a log records (named in a refused ``--resume``).
FLAGS = {"search.factor": "--factor", "search.population": "--population", "search.parents": "--parents",
         "search.progressive": "--progressive", "search.seed": "--seed", "max_windows": "--max-windows",
         "dtype": "--dtype", "model": "MODEL", "gguf_file": "--gguf-file", "data": "--data"}
#: Settings that the model's config decides (a resume with them changed is a resume on another model).
FROM_MODEL = ("trained_length", "rope_theta", "rotary_dim")


class ScoreLog:
    """The JSON-lines log of every scored candidate: a header with the settings, then one line per score.

    On ``resume`` the header must match the settings that change scores (:func:`resume_problem`), and every row is
    checked: a row that is not one the search writes (:func:`row_problem`: not an object, a field missing, a score that
    is not a perplexity) is left out and dropped from the log, so its candidate is scored again if the search reaches
    it; ``rejected`` holds one ``FILE:LINE: what is wrong`` per such row. A last line cut by a kill is dropped
    silently."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool):
        self.path = Path(path)
        self.scores: dict[str, float] = {}
        self.rejected: list[str] = []
        if resume and self.path.exists():
            self._resume(header)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(header) + "\n", encoding="utf-8")

    def _resume(self, header: dict[str, Any]) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        cut = bool(lines[-1].strip())  # text after the last newline: a write a kill interrupted
        rows = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
        first = _parse(rows[0][1]) if rows else None
        logged = first.get("settings") if isinstance(first, dict) else None
        if not isinstance(logged, dict):
            raise ValueError(f"cannot resume {self.path}:{rows[0][0] if rows else 1}: its first line is not a search "
                             "log's header (the settings); give the --out of a search, or start a new one in "
                             "another --out")
        problem = resume_problem(logged, header.get("settings") or {}, self.path)
        if problem:
            raise ValueError(problem)
        kept = [rows[0][1]]
        for index, (number, line) in enumerate(rows[1:], 1):
            rec = _parse(line)
            if rec is _UNREADABLE and cut and index == len(rows) - 1:  # the line a kill cut: scored again
                continue
            why = row_problem(rec)
            if why:
                self.rejected.append(f"{self.path}:{number}: {why}")
                continue
            self.scores[_key(rec["stage"], rec["factors"])] = float(rec["score"])
            kept.append(line)
        if len(kept) != len(rows) or not data.endswith(b"\n"):
            write_atomic(self.path, b"".join(line + b"\n" for line in kept))  # appends start on a fresh line

    def get(self, stage: float, factors: list[float]) -> float | None:
        return self.scores.get(_key(stage, factors))

    def add(self, stage: float, factors: list[float], score: float, label: str) -> None:
        self.scores[_key(stage, factors)] = score
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"stage": stage, "label": label, "score": score, "factors": factors}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


_UNREADABLE = object()


def _parse(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, nested too deep
        return _UNREADABLE


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _is_score(value: Any) -> bool:
    """A perplexity (>= 1: the exponential of a mean negative log-likelihood), or infinity for a failed run."""
    return _real(value) and value >= 1 and not math.isnan(value)


def _is_factors(value: Any) -> bool:
    return (isinstance(value, list) and bool(value) and all(_real(x) and math.isfinite(x) and x >= 1 for x in value)
            and all(a <= b for a, b in zip(value, value[1:])))


#: What a score row must hold: field -> (check, what it should be). Rows are written by :meth:`ScoreLog.add`.
_ROW_FIELDS = {
    "stage": (lambda v: _real(v) and math.isfinite(v) and v > 1, "the stage's factor, a number > 1"),
    "label": (lambda v: isinstance(v, str), "a string"),
    "score": (_is_score, "a perplexity: a number >= 1, or Infinity for a failed run"),
    "factors": (_is_factors, "a non-decreasing list of numbers >= 1"),
}


def row_problem(row: Any) -> str | None:
    """Why ``row`` (a parsed line of the log) is not a score row the search wrote; None if it is one."""
    if row is _UNREADABLE:
        return "not a line of JSON"
    if not isinstance(row, dict):
        return f"not a JSON object but {_shown(row)}"
    for name, (ok, want) in _ROW_FIELDS.items():
        if name not in row:
            return f"no field {name!r}"
        if not ok(row[name]):
            return f"field {name!r} is {_shown(row[name])}, expected {want}"
    return None


def resume_problem(logged: dict[str, Any], settings: dict[str, Any], path: Path) -> str | None:
    """Why the search whose log header holds ``logged`` cannot be resumed with ``settings``, or None.

    Compared: what changes the scores. The search's settings but its budget and clock (a resume may extend them), the
    scoring and the model's config; the model's files and the calibration tokens by their fingerprints, so that the
    same model or text under another spelling of its path (``./m``, an absolute path, ``reference:NAME``) resumes.
    The paths themselves are compared only where a log lacks the fingerprint (logs written before it was recorded;
    a hub id)."""
    logged_files, files = logged.get("model_files"), settings.get("model_files")
    have_files = logged_files is not None and files is not None
    if have_files and logged_files != files:
        return (f"cannot resume {path}: the model {settings.get('model')} is not the one the search began with (its "
                f"config.json or weight files differ); resume with that model, or start a new search in another --out")
    logged_data, data = logged.get("data_sha256"), settings.get("data_sha256")
    have_data = logged_data is not None and data is not None
    if have_data and logged_data != data:  # the scores are of that text
        return (f"cannot resume {path}: the calibration text {settings.get('data')} is not the one the search began "
                f"with (its tokens differ); resume with the same --data, or start a new search in another --out")
    skip = {"model_files", "data_sha256"}
    search_logged, search_now = logged.get("search"), settings.get("search")
    if isinstance(search_logged, dict) and isinstance(search_now, dict):  # compared key by key, below
        skip.add("search")
    else:
        search_logged = search_now = {}
    if have_files and isinstance(files, dict) and "model" in files:  # a local folder: its files identify it
        skip |= {"model", "gguf_file"}
    if have_data:
        skip |= {"data", "tokens"}
    differ = [(f"search.{k}", search_logged.get(k), search_now.get(k))
              for k in sorted(set(search_logged) | set(search_now), key=str)
              if k not in ("budget", "minutes") and search_logged.get(k) != search_now.get(k)]
    differ += [(k, logged.get(k), settings.get(k)) for k in sorted(set(logged) | set(settings), key=str)
               if k not in skip and logged.get(k) != settings.get(k)]
    if not differ:
        return None
    said = "; ".join(f"{key.removeprefix('search.')}{f' ({FLAGS[key]})' if key in FLAGS else ''}: {_shown(then)} in "
                     f"the log, {_shown(now)} now" for key, then, now in differ)
    keys = [key for key, _, _ in differ]
    if any(key in FROM_MODEL for key in keys):
        advice = "resume with the model the search began with"
    elif "tokens" in keys or "data" in keys:
        advice = "resume with the --data the search began with"
    elif all(key in FLAGS for key in keys):
        advice = "resume with " + " ".join(_as_flag(FLAGS[key], then) for key, then, _ in differ)
    else:
        advice = "resume with the settings the search began with"
    return f"cannot resume {path}: it was written with other settings ({said}); {advice}, or start a new search " \
           "with these settings in another --out"


def _as_flag(flag: str, value: Any) -> str:
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {value}"


#: Generations in a row at the widest step (random candidates over the whole constrained space) that find no unseen
#: candidate before a stage counts as exhausted (where the space is not yet counted out as fully scored).
WIDEST_TRIES = 100


def space_size(dims: int, upper: float) -> int:
    """How many candidates the constraint allows with ``dims`` factors in [1, ``upper``] at ``DECIMALS`` decimals:
    non-decreasing sequences over the grid's points."""
    points = round(upper * 10**DECIMALS) - 10**DECIMALS + 1
    return math.comb(points + dims - 1, dims)


def search(score: Callable[[float, list[float]], float], starts: Callable[[float], dict[str, list[float]]],
           settings: SearchSettings, log: ScoreLog, progress: Callable[[int, float], None] | None = None
           ) -> dict[str, Any]:
    """Run the search. ``score(stage_factor, factors)`` gives perplexity (lower is better; inf for a failed run);
    ``starts(stage_factor)`` the named starting candidates; ``progress(scored, best)`` after each score.

    A generation whose children are all in the population already (it has converged for the mutation step) is followed
    by generations with a wider step (mutation rate and scale doubled at each), up to random candidates over the
    whole constrained space, until one finds an unseen candidate: a stage ends only when its budget is spent, the
    clock runs out or every candidate has been scored (``exhausted``). A resume with a larger budget thus continues.

    Returns the final stage's best factors and score, every starting candidate's score there, the number of
    candidates scored (``scored``, cached ones included), whether the clock ended it, ``stopped``: ``"budget"``,
    ``"minutes"`` or ``"exhausted"``, and with the last ``exhausted``: how many candidates were scored of how many."""
    rng = random.Random(settings.seed)
    deadline = None if settings.minutes is None else time.monotonic() + 60 * settings.minutes
    stages = settings.stages()
    state = {"scored": 0, "fresh": 0, "out_of_time": False, "exhausted": False}
    result: dict[str, Any] = {}
    previous_best: tuple[float, list[float]] | None = None

    def evaluate(stage: float, factors: list[float], label: str) -> float | None:
        if state["scored"] >= settings.budget:
            return None
        if deadline is not None and time.monotonic() > deadline and log.get(stage, factors) is None:
            state["out_of_time"] = True
            return None
        value = log.get(stage, factors)
        if value is None:
            value = float(score(stage, factors))
            value = value if math.isfinite(value) else math.inf
            log.add(stage, factors, value, label)
            state["fresh"] += 1
        state["scored"] += 1
        if progress is not None:
            progress(state["scored"], value)
        return value

    for index, stage in enumerate(stages):
        upper = 2.0 * stage
        stage_budget = settings.budget if index == len(stages) - 1 else \
            state["scored"] + max(len(starts(stage)) + 1, (settings.budget - state["scored"]) // (len(stages) - index))
        state["exhausted"] = False

        def fit(factors) -> list[float]:
            return [round(x, DECIMALS) for x in monotone(factors, upper)]

        seeds = {name: fit(f) for name, f in starts(stage).items()}
        if previous_best is not None:
            prev_stage, prev = previous_best
            seeds["previous stage"] = fit([x * stage / prev_stage for x in prev])
        population: dict[str, tuple[float, list[float]]] = {}  # key -> (score, factors)
        seen: set[str] = set()  # every candidate evaluated at this stage
        start_scores: dict[str, float] = {}
        for name, factors in seeds.items():
            value = evaluate(stage, factors, name)
            if value is None:
                break
            start_scores[name] = value
            population[json.dumps(factors)] = (value, factors)
            seen.add(json.dumps(factors))
        seed_list = list(seeds.values())
        dims = len(seed_list[0]) if seed_list else 0
        size = space_size(dims, upper) if dims else 0
        # the step at which a mutation reaches across the whole range: from there on, random candidates
        widest = max(1, math.ceil(math.log2(max(1.0, math.log(upper) / settings.mutation_scale))))

        def mutate(factors: list[float], level: int = 0) -> list[float]:
            rate = min(1.0, settings.mutation_rate * 2**level)
            scale = settings.mutation_scale * 2**level
            return fit([x * math.exp(rng.gauss(0.0, scale)) if rng.random() < rate else x for x in factors])

        def crossover(a: list[float], b: list[float]) -> list[float]:
            return fit([x if rng.random() < 0.5 else y for x, y in zip(a, b)])

        def anywhere() -> list[float]:
            return fit(sorted(rng.uniform(1.0, upper) for _ in range(dims)))

        attempts = 0
        while len(population) < settings.population and state["scored"] < stage_budget and attempts < 50:
            attempts += 1
            child = mutate(rng.choice(seed_list))
            if json.dumps(child) in seen:
                continue
            value = evaluate(stage, child, "mutation")
            if value is None:
                break
            population[json.dumps(child)] = (value, child)
            seen.add(json.dumps(child))
        level = 0  # 0: the search's own step; 1, 2, ...: wider after generations that made nothing new
        widest_misses = 0
        while state["scored"] < stage_budget and not state["out_of_time"] and population:
            if len(seen) >= size:  # every candidate the constraint allows has a score
                state["exhausted"] = f"all {size} candidates within the constraint at x{stage:g} are scored"
                break
            ranked = sorted(population.values(), key=lambda item: item[0])
            parents = [f for _, f in ranked[: settings.parents]]
            made = 0
            for _ in range(settings.population):
                if level == 0:  # the search's own step
                    if len(parents) > 1 and rng.random() < 0.5:
                        a, b = rng.sample(parents, 2)
                        child, label = crossover(a, b), "crossover"
                    else:
                        child, label = mutate(rng.choice(parents)), "mutation"
                elif level < widest:
                    child, label = mutate(rng.choice(parents), level), "mutation"
                else:
                    child, label = anywhere(), "random"
                if json.dumps(child) in seen:  # one evaluated at this stage already: no new information
                    continue
                value = evaluate(stage, child, label)
                if value is None:
                    break
                population[json.dumps(child)] = (value, child)
                seen.add(json.dumps(child))
                made += 1
            ranked = sorted(population.values(), key=lambda item: item[0])
            population = {json.dumps(f): (s, f) for s, f in ranked[: settings.population]}
            if made:
                level, widest_misses = 0, 0
            elif level < widest:  # every child seen before: the population has converged for this step size
                level += 1
            else:
                widest_misses += 1
                if widest_misses >= WIDEST_TRIES:  # random candidates find nothing new: (all but) every one scored
                    state["exhausted"] = (f"{len(seen)} of the {size} candidates within the constraint at "
                                          f"x{stage:g} are scored, and {WIDEST_TRIES * settings.population} random "
                                          "ones found no other")
                    break
        if not population:
            break
        best_score, best = min(population.values(), key=lambda item: item[0])
        previous_best = (stage, best)
        result = {"stage": stage, "best": best, "best_score": best_score, "starts": start_scores,
                  "start_factors": {name: seeds[name] for name in start_scores}}
    stopped = "minutes" if state["out_of_time"] else "exhausted" if state["exhausted"] else "budget"
    result.update(scored=state["scored"], fresh=state["fresh"], out_of_time=state["out_of_time"], stopped=stopped,
                  exhausted=state["exhausted"] or None, stages=stages, settings=asdict(settings))
    return result


__all__ = ["DECIMALS", "ScoreLog", "SearchSettings", "row_problem", "search", "space_size"]
