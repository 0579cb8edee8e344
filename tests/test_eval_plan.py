"""`ctxext eval` plans its run once (``ctxext.evaluation.plan``): ``--methods`` is parsed once, into requests whose
factor each model fills in, and the plan carries every setting the runner, the resume check and the document read."""

from __future__ import annotations

import json

import pytest

from test_eval_fixtures import CORPUS, save_tiny_llama

from ctxext.cli import build_parser, main
from ctxext.evaluation.requests import MethodChoice, parse_methods, with_factor


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "llama")


def _plan(argv):
    from ctxext.commands.eval import request_from_args
    from ctxext.evaluation.plan import plan_eval

    return plan_eval(request_from_args(build_parser().parse_args(argv)))


def _pairs(requests):
    return [(r.method, r.factor) for r in requests]


@pytest.mark.parametrize("spec", ["none,pi,pi:4,nope,yarn:2", "pi:4,pi,ntk", "yarn,none,yarn:2,YARN"])
@pytest.mark.parametrize("factor", [None, 2.0, 4.0])
def test_a_factor_filled_in_later_gives_the_requests_of_one_parse(spec, factor):
    choice = MethodChoice.parse(spec)
    assert with_factor(list(choice.given), factor) == parse_methods(spec, factor=factor)


def test_the_choice_tells_the_default_set_and_patching():
    assert MethodChoice.parse(None).given is None and MethodChoice.parse("").given is None
    assert _pairs(MethodChoice.parse("none,pi,pi:4").given) == [("none", None), ("pi", None), ("pi", 4.0)]
    assert MethodChoice.parse("none,pi").patches and not MethodChoice.parse("none").patches
    assert not MethodChoice.parse(None).patches
    with pytest.raises(ValueError, match="KEY=VALUE"):
        MethodChoice.parse(None, options=["beta_fast"])  # the form of an option is checked without --methods too


def test_the_plan_holds_the_run(llama_dir, tmp_path):
    plan = _plan(["eval", "--model", str(llama_dir), "--data", str(CORPUS), "--lengths", "128,64", "--methods",
                  "none,yarn:2,pi", "--passkey", "--max-windows", "3", "--device", "cpu",
                  "--output", str(tmp_path / "r.json")])
    s = plan.settings
    assert _pairs(s.methods.given) == [("none", None), ("yarn", 2.0), ("pi", None)]  # pi: factor from the lengths
    assert s.lengths == [64, 128] and s.perplexity and s.passkey and s.tasks == [] and s.max_windows == 3
    assert s.max_tokens is None and plan.plot is None and plan.heatmap is None and not plan.demo
    assert [j.label for j in plan.jobs] == ["llama"] and plan.jobs[0].factor is None
    assert plan.as_given == {"methods": "none,yarn:2,pi", "factor": None, "options": [], "lengths": [64, 128]}
    assert not (tmp_path / "r.json").exists()  # a plan writes nothing


def test_methods_are_parsed_once_per_run(llama_dir, tmp_path, monkeypatch):
    import ctxext.evaluation.requests as requests

    given = []
    real = requests.parse_methods

    def counted(spec, **kwargs):
        if spec:
            given.append(spec)
        return real(spec, **kwargs)

    monkeypatch.setattr(requests, "parse_methods", counted)
    out = tmp_path / "r.json"
    assert main(["eval", "--no-progress", "--device", "cpu", "--model", str(llama_dir), "--data", str(CORPUS),
                 "--lengths", "64,128", "--methods", "none,pi", "--max-windows", "1", "--output", str(out)]) == 0
    assert given == ["none,pi"]  # the plan parses it; the preflight and the runner fill in each model's factor
    rows = json.loads(out.read_text())["results"]
    assert [(r["method"], r["factor"], r["length"]) for r in rows] == [
        ("none", None, 64), ("none", None, 128), ("pi", 2.0, 64), ("pi", 2.0, 128)]
