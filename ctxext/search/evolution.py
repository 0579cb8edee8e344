"""LongRoPE's evolutionary search over per-dimension rescale factors (Ding et al. 2024, Section 3.2 and Algorithm 1;
microsoft/LongRoPE's ``evolution/``), scored by a caller's function (perplexity at the target length).

- **Population.** The starting candidates (PI, YaRN and NTK factors at the stage's factor; at a later stage of a
  progressive search also the previous stage's best, scaled to the new factor) are scored first, then mutations of
  them fill the population.
- **Each generation** keeps the best ``parents`` and makes as many children as the population holds: half by mutation
  (each factor multiplied by a log-normal step with probability ``mutation_rate``), half by crossover (each factor
  from one of two parents); the population is the best of parents and children.
- **Monotonicity constraint**: every candidate is projected onto it (factors >= 1, non-decreasing in the frequency
  index, at most twice the stage's factor) instead of being discarded, as LongRoPE does with its invalid ones.
- **Progressive extension** (``progressive``): the factor doubles from 2 to the target, each stage seeded by the one
  before, as LongRoPE reaches 256k from 128k.
- **Budget**: ``budget`` scored candidates in all (split between the stages), and optionally ``minutes`` of wall
  time. Candidates are rounded to 4 decimals, so what is logged is exactly what was scored.
- **Resumable**: every score goes to a JSON-lines log as it is made. The search is deterministic given its seed and the
  scores, so a resumed run replays the same candidates and takes their scores from the log instead of re-scoring.

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


class ScoreLog:
    """The JSON-lines log of every scored candidate: a header with the settings, then one line per score."""

    def __init__(self, path: Path, header: dict[str, Any], resume: bool):
        self.path = Path(path)
        self.scores: dict[str, float] = {}
        if resume and self.path.exists():
            lines = self.path.read_text(encoding="utf-8").splitlines()
            first = json.loads(lines[0]) if lines else {}
            if _comparable(first.get("settings")) != _comparable(header.get("settings")):
                raise ValueError(f"cannot resume {self.path}: it was written with other settings "
                                 f"({first.get('settings')}); start over with --overwrite")
            logged_files = (first.get("settings") or {}).get("model_files")
            files = (header.get("settings") or {}).get("model_files")
            if logged_files is not None and files is not None and logged_files != files:
                raise ValueError(f"cannot resume {self.path}: the model at {header['settings'].get('model')} is not "
                                 "the one the search began with (its config.json or weight files differ); start over "
                                 "with --overwrite")
            logged_data = (first.get("settings") or {}).get("data_sha256")
            data = (header.get("settings") or {}).get("data_sha256")
            if logged_data is not None and data is not None and logged_data != data:  # the scores are of that text
                raise ValueError(f"cannot resume {self.path}: the calibration text {header['settings'].get('data')} "
                                 "is not the one the search began with (its tokens differ); resume with the same "
                                 "--data, or start over with --overwrite")
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill: scored again
                    continue
                self.scores[_key(rec["stage"], rec["factors"])] = float(rec["score"])
            self._rewrite(lines)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(header) + "\n", encoding="utf-8")

    def _rewrite(self, lines: list[str]) -> None:
        """Drop a last line cut mid-write, so appends start on a fresh line."""
        good = [ln for ln in lines if _parses(ln)]
        self.path.write_text("".join(ln + "\n" for ln in good), encoding="utf-8")

    def get(self, stage: float, factors: list[float]) -> float | None:
        return self.scores.get(_key(stage, factors))

    def add(self, stage: float, factors: list[float], score: float, label: str) -> None:
        self.scores[_key(stage, factors)] = score
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"stage": stage, "label": label, "score": score, "factors": factors}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _comparable(settings: Any) -> Any:
    """What a resumed search must share with the logged one: everything but its budget and clock (a resume may
    extend them; the replay takes the same path as far as the log goes)."""
    if not isinstance(settings, dict):
        return settings
    search = {k: v for k, v in (settings.get("search") or {}).items() if k not in ("budget", "minutes")}
    rest = {k: v for k, v in settings.items() if k not in ("model_files", "data_sha256")}  # compared on their own
    # (older logs lack them)
    return {**rest, "search": search}


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except json.JSONDecodeError:
        return False
    return True


def search(score: Callable[[float, list[float]], float], starts: Callable[[float], dict[str, list[float]]],
           settings: SearchSettings, log: ScoreLog, progress: Callable[[int, float], None] | None = None
           ) -> dict[str, Any]:
    """Run the search. ``score(stage_factor, factors)`` gives perplexity (lower is better; inf for a failed run);
    ``starts(stage_factor)`` the named starting candidates; ``progress(scored, best)`` after each score.

    Returns the final stage's best factors and score, every starting candidate's score there, the number of
    candidates scored (``scored``, cached ones included) and whether the budget or the clock ended it."""
    rng = random.Random(settings.seed)
    deadline = None if settings.minutes is None else time.monotonic() + 60 * settings.minutes
    stages = settings.stages()
    state = {"scored": 0, "fresh": 0, "out_of_time": False}
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

        def fit(factors) -> list[float]:
            return [round(x, DECIMALS) for x in monotone(factors, upper)]

        seeds = {name: fit(f) for name, f in starts(stage).items()}
        if previous_best is not None:
            prev_stage, prev = previous_best
            seeds["previous stage"] = fit([x * stage / prev_stage for x in prev])
        population: dict[str, tuple[float, list[float]]] = {}  # key -> (score, factors)
        start_scores: dict[str, float] = {}
        for name, factors in seeds.items():
            value = evaluate(stage, factors, name)
            if value is None:
                break
            start_scores[name] = value
            population[json.dumps(factors)] = (value, factors)
        seed_list = list(seeds.values())

        def mutate(factors: list[float]) -> list[float]:
            return fit([x * math.exp(rng.gauss(0.0, settings.mutation_scale)) if rng.random() < settings.mutation_rate
                        else x for x in factors])

        def crossover(a: list[float], b: list[float]) -> list[float]:
            return fit([x if rng.random() < 0.5 else y for x, y in zip(a, b)])

        attempts = 0
        while len(population) < settings.population and state["scored"] < stage_budget and attempts < 50:
            attempts += 1
            child = mutate(rng.choice(seed_list))
            if json.dumps(child) in population:
                continue
            value = evaluate(stage, child, "mutation")
            if value is None:
                break
            population[json.dumps(child)] = (value, child)
        while state["scored"] < stage_budget and not state["out_of_time"] and population:
            ranked = sorted(population.values(), key=lambda item: item[0])
            parents = [f for _, f in ranked[: settings.parents]]
            made = 0
            for _ in range(settings.population):
                if len(parents) > 1 and rng.random() < 0.5:
                    a, b = rng.sample(parents, 2)
                    child, label = crossover(a, b), "crossover"
                else:
                    child, label = mutate(rng.choice(parents)), "mutation"
                if json.dumps(child) in population:
                    continue
                value = evaluate(stage, child, label)
                if value is None:
                    break
                population[json.dumps(child)] = (value, child)
                made += 1
            ranked = sorted(population.values(), key=lambda item: item[0])
            population = {json.dumps(f): (s, f) for s, f in ranked[: settings.population]}
            if made == 0:  # every child already seen: the population has converged for this step size
                break
        if not population:
            break
        best_score, best = min(population.values(), key=lambda item: item[0])
        previous_best = (stage, best)
        result = {"stage": stage, "best": best, "best_score": best_score, "starts": start_scores,
                  "start_factors": {name: seeds[name] for name in start_scores}}
    result.update(scored=state["scored"], fresh=state["fresh"], out_of_time=state["out_of_time"],
                  stages=stages, settings=asdict(settings))
    return result


__all__ = ["DECIMALS", "ScoreLog", "SearchSettings", "search"]
