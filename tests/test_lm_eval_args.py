"""Issue 28: `ctxext lm-eval` checks its arguments as `ctxext eval` does, before any model or task loads.

Unknown or misspelled ``--model_args`` keys (``beta_fsat=16``, ``bogus=3``), a dtype no loader knows
(``dtype=float8``), empty values, keys given twice, items without ``=`` and misspelled task names are each refused
with one ``ctxext lm-eval: error: ...`` line naming the bad key or value, exit code 2. They used to reach
transformers (a TypeError / AttributeError after task indexing, about 25 s on a 2-core machine) or lm-eval's
task loader. Every test here makes lm-eval's model constructor and task loader fail the test if they are called.
"""

from __future__ import annotations

import contextlib
import functools
import io
import time

import pytest

pytest.importorskip("lm_eval")

from refusals import assert_refused
from test_eval_fixtures import save_tiny_llama

#: Seconds an in-process refusal may take (as in test_refusals_lm_eval.py: a loaded 2-core machine, the first
#: refusal of a session imports lm-eval's modules). Measured: 0.05-1.5 s.
FAST_S = 10.0


class Loaded(Exception):
    """Raised by the stand-ins below: something loaded that must not have."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(save_tiny_llama(tmp_path_factory.mktemp("lm_args") / "llama"))


@pytest.fixture(scope="module")
def task_cache(tmp_path_factory):
    """A task-name cache of this module's own (the user's stays untouched), filled once by a refusal on a cold
    cache: (its seconds, its stderr). Indexing lm-eval's ~14,000 task YAML files takes 15-20 s here."""
    import os

    from ctxext.cli import main

    folder = tmp_path_factory.mktemp("task_cache")
    saved = os.environ.get("CTXEXT_CACHE_DIR")
    os.environ["CTXEXT_CACHE_DIR"] = str(folder)
    llama = save_tiny_llama(folder.parent / "cold_llama")
    err = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stderr(err):
        rc = main(["lm-eval", "--model", "ctxext", "--model_args", f"pretrained={llama}", "--device", "cpu",
                   "--tasks", "hellaswagg"])
    seconds = time.perf_counter() - start
    yield {"rc": rc, "seconds": seconds, "stderr": err.getvalue(), "folder": folder}
    if saved is None:
        os.environ.pop("CTXEXT_CACHE_DIR", None)
    else:
        os.environ["CTXEXT_CACHE_DIR"] = saved


@pytest.fixture(autouse=True)
def nothing_loads(monkeypatch, task_cache):
    """lm-eval's hf model constructor and its task loader fail the test if called; offline hub."""
    import lm_eval.tasks

    import ctxext.integrations.lm_eval as m

    @functools.wraps(m.HFLM.__init__)  # keeps its signature, which ctxext reads for the accepted keys
    def model_loaded(*args, **kwargs):
        raise Loaded("the model began to load before its arguments were checked")

    def tasks_loaded(*args, **kwargs):
        raise Loaded("tasks began to load before the arguments were checked")

    monkeypatch.setattr(m.HFLM, "__init__", model_loaded)
    monkeypatch.setattr(lm_eval.tasks.TaskManager, "load", tasks_loaded)
    if hasattr(lm_eval.tasks, "get_task_dict"):
        monkeypatch.setattr(lm_eval.tasks, "get_task_dict", tasks_loaded)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(task_cache["folder"]))


@pytest.fixture
def watch(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out


def _refuse(argv_model_args, watch, capsys, expect, *, tasks="ctxext_no_such_task", extra=()):
    argv = ["lm-eval", "--model", "ctxext"]
    for args in argv_model_args if isinstance(argv_model_args, list) else [argv_model_args]:
        argv += ["--model_args", args]
    argv += ["--device", "cpu", "--output_path", str(watch), "--tasks", tasks, *extra]
    start = time.perf_counter()
    try:
        line = assert_refused(argv, capsys, watch, expect)
    except Loaded as exc:  # today's code: the model or the tasks loaded first
        pytest.fail(str(exc))
    seconds = time.perf_counter() - start
    assert seconds < FAST_S, f"refusal took {seconds:.1f} s"
    assert line.startswith("ctxext lm-eval: error: "), line
    return line


# --- the reported cases ------------------------------------------------------------------------------------------


def test_misspelled_method_option_is_named_with_the_accepted_ones(llama, watch, capsys):
    line = _refuse(f"pretrained={llama},method=yarn,factor=4,beta_fsat=16", watch, capsys, "beta_fsat")
    assert "beta_fast" in line and "beta_slow" in line and "'yarn'" in line  # the accepted options of yarn
    assert "did you mean beta_fast" in line


def test_unknown_key_is_named_with_the_accepted_ones(llama, watch, capsys):
    line = _refuse(f"pretrained={llama},bogus=3", watch, capsys, "bogus")
    for accepted in ("pretrained", "method", "factor", "adapter", "dtype", "batch_size", "max_length"):
        assert accepted in line, accepted


def test_unknown_dtype_is_named_with_the_accepted_ones(llama, watch, capsys):
    line = _refuse(f"pretrained={llama},dtype=float8", watch, capsys, "float8")
    for accepted in ("auto", "float32", "bfloat16", "float16"):
        assert accepted in line, accepted


def test_misspelled_task_name_is_refused_on_a_cold_cache(task_cache):
    """The first check in a fresh cache indexes lm-eval's task YAML files (no data), as lm-eval itself would."""
    err = task_cache["stderr"]
    assert task_cache["rc"] == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ctxext lm-eval: error: --tasks"), err
    assert "hellaswagg" in lines[0] and "did you mean hellaswag" in lines[0]
    assert any(task_cache["folder"].iterdir()), "the task index was not cached"


def test_misspelled_task_name_is_refused_quickly_with_the_index_cached(llama, watch, capsys):
    line = _refuse(f"pretrained={llama}", watch, capsys, "hellaswagg", tasks="arc_easy,hellaswagg")
    assert "did you mean hellaswag" in line and "arc_easy" not in line.split("hellaswagg")[0]


# --- more hostile input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_args,expect", [
    ("method=pi,factor=", "factor= has no value"),
    ("dtype=", "dtype= has no value"),
    ("method=pi,factor=2,factor=4", "factor is given twice"),
    ("method=pi,bogus", "'bogus' is not key=value"),
    ("method=pi,=4", "'=4' has no key"),
    ("dtype=int8", "int8"),
    ("dtype=cuda", "cuda"),
    ("softmax_dtype=float8", "float8"),
    ("Method=yarn,factor=4", "unknown key(s) Method (did you mean method?)"),
], ids=["empty-factor", "empty-dtype", "key-twice", "no-equals", "no-key", "dtype-int8", "dtype-not-a-dtype",
        "softmax-dtype", "key-case"])
def test_hostile_model_args(llama, watch, capsys, model_args, expect):
    # a non-numeric factor (factor=abc) and a misspelled method were refused already: test_refusals_lm_eval.py
    _refuse(f"pretrained={llama},{model_args}", watch, capsys, expect)


def test_key_given_twice_across_model_args_flags(llama, watch, capsys):
    _refuse([f"pretrained={llama},method=pi,factor=2", "factor=8"], watch, capsys, "factor is given twice")


def test_empty_include_of_tasks_glob_is_refused(llama, watch, capsys, tmp_path):
    _refuse(f"pretrained={llama}", watch, capsys, "no_such.yaml", tasks=str(tmp_path / "no_such.yaml"))


# --- what is accepted ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_args", [
    {"method": "yarn", "factor": 4, "beta_fast": 16},
    {"dtype": "auto", "batch_size": "auto", "max_length": 128},
    {"dtype": "float64"}, {"dtype": "half"}, {"dtype": "bfloat16"}, {"softmax_dtype": "float32"},
    {"attn_implementation": "eager"},  # transformers' from_pretrained
    {"use_cache": False, "pad_token_id": 0},  # attributes of the model's config
    {"subfolder": ""},  # empty, as lm-eval's own default
], ids=["method", "hf-args", "float64", "half", "bfloat16", "softmax-dtype", "from-pretrained-kwarg",
        "config-attributes", "empty-default"])
def test_accepted_model_args(llama, model_args):
    from ctxext.integrations.lm_eval import check_model_args

    check_model_args({"pretrained": llama, **model_args})


def test_known_task_names_globs_and_include_path_pass(tmp_path):
    from ctxext.integrations.lm_eval_tasks import check_tasks

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "mine.yaml").write_text("task: ctxext_mine\ndataset_path: json\noutput_type: loglikelihood\n")
    start = time.perf_counter()
    check_tasks("hellaswag,arc_*", None)
    check_tasks(["ctxext_mine", "mmlu"], str(folder))
    assert time.perf_counter() - start < FAST_S
    with pytest.raises(ValueError, match="ctxext_mine"):
        check_tasks("ctxext_mine", None)  # only with its --include_path


def test_index_is_built_once_per_folder_per_command(tmp_path):
    """Within one `ctxext lm-eval` command, the index ctxext builds for its check is the one lm-eval then uses
    (a cold cache would otherwise index the task folder twice), and it is the index lm-eval builds itself."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import TaskIndex

    from ctxext.compat.lm_eval import index_built_once

    a, b = tmp_path / "a", tmp_path / "b"
    for folder, names in ((a, ("x1", "x2")), (b, ("x2", "x3"))):
        folder.mkdir()
        for name in names:
            (folder / f"{name}.yaml").write_text(f"task: {name}\ntag: t_{folder.name}\n")
    plain = TaskManager(include_path=[str(a), str(b)], include_defaults=False).task_index
    calls = []
    original = TaskIndex.__dict__["build"]

    def counting(paths, **kwargs):
        calls.append([str(p) for p in paths])
        return original.__func__(paths, **kwargs)

    TaskIndex.build = staticmethod(counting)
    try:
        with index_built_once():
            TaskManager(include_path=str(b), include_defaults=False)
            reused = TaskManager(include_path=[str(a), str(b)], include_defaults=False).task_index
    finally:
        TaskIndex.build = original
    assert TaskIndex.__dict__["build"] is original
    assert sorted(map(tuple, calls)) == [(str(a),), (str(b),)]
    assert {k: (v.kind, v.yaml_path, v.tags) for k, v in reused.items()} == \
        {k: (v.kind, v.yaml_path, v.tags) for k, v in plain.items()}


# --- the Python API -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,expect", [
    ("method=yarn,factor=4,beta_fsat=16", "beta_fsat"),
    ("bogus=3", "bogus"),
    ("dtype=float8", "float8"),
    ("method=pi,factor=2,factor=4", "factor is given twice"),
    ("method=pi,factor=", "factor= has no value"),
], ids=["misspelled-option", "unknown-key", "dtype", "key-twice", "empty-factor"])
def test_python_api_refuses_before_loading(llama, args, expect):
    import ctxext.integrations.lm_eval as m

    with pytest.raises((ValueError, OSError)) as exc:
        m.CtxextLM.create_from_arg_string(f"pretrained={llama},{args}", {"device": "cpu"})
    assert expect.lower() in str(exc.value).lower()
    assert "\n" not in str(exc.value)
