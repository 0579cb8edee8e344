"""`ctxext finetune` refuses bad input before any model loads: exit 2, one `ctxext finetune: error: ...` line with
the key path, no traceback, and nothing under the working folder changed (a finished run there stays as it was).
Also: every recipe in recipes/tiny/ passes --check from any working directory, with no data outside the package."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).parent))
from refusals import assert_refused  # noqa: E402

from ctxext.cli import main  # noqa: E402
from ctxext.finetune import recipe_from_dict  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = sorted((REPO / "recipes" / "tiny").glob("*.yaml"))

#: A small valid recipe on the shipped LLaMA reference checkpoint and shipped text (paths relative to its folder).
BASE = {
    "model": {"name": "reference:llama"},
    "patch": {"method": "pi", "factor": 2},
    "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "data": {"files": ["books"]},
    "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 1},
    "eval": {"data": "reference", "max_windows": 2},
    "output": {"dir": "runs/new"},
}


def _set(d: dict, dotted: str, value) -> dict:
    section, key = dotted.split(".", 1)
    d = json.loads(json.dumps(d))
    d.setdefault(section, {})[key] = value
    return d


def _yaml(d: dict) -> str:
    return yaml.safe_dump(d, sort_keys=False)


# Each case: (id, recipe text or None for the base recipe, extra argv, text the error line must contain).
# Recipes are written to work/r.yaml; the working directory is work/, which holds a finished run in runs/done/.
CASES = [
    ("missing-recipe", None, ["--recipe", "nothere.yaml"], "recipe 'nothere.yaml' not found"),
    ("recipe-is-folder", None, ["--recipe", "runs"], "is a folder"),
    ("empty-file", "", [], "r.yaml is empty"),
    ("only-comments", "# a recipe to be\n", [], "r.yaml is empty"),
    ("yaml-syntax", "model:\n  name: reference:llama\n train: x\n", [], "r.yaml:3: "),
    ("yaml-unclosed-list", "model:\n  name: reference:llama\ndata:\n  files: [a, b\n", [], "r.yaml:5: "),
    ("scalar-yaml", "just some words\n", [], "must be a mapping with sections model, patch"),
    ("list-yaml", "- model\n- patch\n", [], "must be a mapping with sections model, patch"),
    ("duplicate-key", "model:\n  name: reference:llama\nmodel:\n  name: gpt2\n", [], "r.yaml:3: duplicate key 'model'"),
    ("not-utf8", b"\xff\xfe\x00model", [], "not UTF-8"),
    ("several-wrong-types", _yaml(_set(_set(_set(BASE, "train.steps", "abc"), "lora.r", "many"), "train.lr", "fast")),
     [], "3 problems"),
    ("unknown-section", _yaml({**BASE, "extras": {"x": 1}}), [], "unknown section(s) extras"),
    ("unknown-key", _yaml(_set(BASE, "train.stepz", 5)), [], "unknown key(s) train.stepz; train accepts: steps"),
    ("section-not-mapping", _yaml({**BASE, "train": [1, 2]}), [], "train: input should be a valid dictionary or instance of TrainConfig, got [1, 2]"),
    ("bad-method", _yaml(_set(BASE, "patch.method", "warp")), [], "patch.method: unknown method 'warp'"),
    ("factor-0", _yaml(_set(BASE, "patch.factor", 0)), [], "patch.factor: factor must be >= 1"),
    ("factor-not-a-number", _yaml(_set(BASE, "patch.factor", "big")), [],
     "patch.factor: input should be a valid number, unable to parse string as a number, got 'big'"),
    ("missing-data-file", _yaml(_set(BASE, "data.files", ["books", "gone.txt"])), [],
     "data.files: 'gone.txt' not found (relative paths are read from the recipe folder"),
    ("unknown-shipped-text", _yaml(_set(BASE, "data.files", ["reference:bogus"])), [],
     "unknown shipped text 'reference:bogus'; choose one of reference:train"),
    ("all-data-excluded", _yaml(_set(BASE, "data.exclude", ["*.txt"])), [], "every file is excluded"),
    ("missing-eval-file", _yaml(_set(BASE, "eval.data", ["held.txt"])), [], "eval.data: 'held.txt' not found"),
    ("output-dir-is-file", _yaml(_set(BASE, "output.dir", "notes.txt")), [], "output.dir: 'notes.txt' is a file"),
    # tracebacks before: a number as an option name (TypeError), an index overflow mid-run, ~ of no user
    ("option-name-a-number", _yaml(_set(BASE, "patch.options", {1: 2})), [], "patch.options: unknown option(s) 1"),
    ("steps-past-an-index", _yaml(_set(BASE, "train.steps", 10 ** 23)), [],
     "train.steps: input should be less than 2147483648"),
    ("output-dir-of-no-user", _yaml(_set(BASE, "output.dir", "~nonexistentuser-ctxext/x")), [],
     "output.dir: '~nonexistentuser-ctxext' names no user's home folder here"),
    ("output-dir-under-file", _yaml(_set(BASE, "output.dir", "notes.txt/run")), [], "cannot be made"),
    ("output-holds-finished-run", _yaml(_set(BASE, "output.dir", "runs/done")), [], "holds a finished run"),
    ("output-holds-checkpoints", _yaml(_set(BASE, "output.dir", "runs/stopped")), [],
     "holds checkpoints of an earlier run (checkpoint-2); pass --resume"),
    ("output-holds-old-layout", _yaml(_set(BASE, "output.dir", "runs/old")), ["--resume"],
     "holds checkpoints in ctxext's old layout (checkpoints/step-N/)"),
    ("resume-changed-recipe", _yaml(_set(BASE, "output.dir", "runs/stopped")), ["--resume"],
     "cannot resume from"),
    ("resume-finished-run-with-a-damaged-recipe", _yaml(_set(BASE, "output.dir", "runs/damaged")), ["--resume"],
     "runs/damaged/recipe.yaml of the finished run there is unreadable or not a mapping"),
    ("resume-finished-run-with-another-recipe", _yaml(_set(BASE, "output.dir", "runs/other")), ["--resume"],
     "give another output.dir for a new run (output.overwrite=true would delete this finished one)"),
    ("model-folder-missing", _yaml(_set(BASE, "model.name", "./models/mine")), [], "model.name: folder not found"),
    ("unknown-reference-model", _yaml(_set(BASE, "model.name", "reference:t5")), [],
     "model.name 'reference:t5': unknown reference model 't5'"),
    ("batch-not-multiple", _yaml(_set(_set(BASE, "train.batch_size", 3), "train.micro_batch_size", 2)), [],
     "must be a multiple of train.micro_batch_size"),
    ("bad-scheduler-and-dropout", _yaml(_set(_set(BASE, "train.scheduler", "sawtooth"), "lora.dropout", 1.5)), [],
     "2 problems"),
    ("lora-target-missing", None, ["--set", "lora.target_modules=[query_key_value, c_attn]", "--check"],
     "lora.target_modules: no module named 'query_key_value', 'c_attn' in LlamaForCausalLM"),
    ("set-without-equals", None, ["--set", "train.steps"], "--set expects KEY=VALUE"),
    ("set-empty-key-part", None, ["--set", "train..steps=3"], "bad key 'train..steps'"),
    ("set-whole-section", None, ["--set", "train=3"], "'train' is a whole section"),
    ("set-unknown-section", None, ["--set", "trian.steps=3"], "unknown section 'trian'"),
    ("set-through-a-value", None, ["--set", "train.steps.x=1"], "train.steps is not a section"),
    ("set-and-recipe-errors-together", _yaml(_set(BASE, "train.steps", "abc")), ["--set", "lora.r=zero"],
     "2 problems"),
    ("absurd-accumulation", _yaml(_set(BASE, "train.batch_size", 10 ** 12)), ["--check"],
     "1000000000000 micro-batches per optimizer step"),
    ("seed-out-of-range", _yaml(_set(BASE, "train.seed", -1)), [], "train.seed: input should be greater than or equal to 0, got -1"),
    ("output-dir-under-dangling-link", None, ["--set", "output.dir=gone/run", "--check"], "is a link to nothing"),
    ("stop-after-0", None, ["--stop-after", "0"], "--stop-after must be >= 1"),
    ("stop-after-not-int", None, ["--stop-after", "two"], "invalid int value"),
    ("check-and-print", None, ["--check", "--print-recipe"], "give one of them"),
]


@pytest.fixture
def work(tmp_path, monkeypatch):
    """work/: books/ (training text), held-out file absent, notes.txt (a file), gone (a link to nothing), runs/done
    (a finished run), runs/stopped (an interrupted run's checkpoint); the working directory for every case."""
    w = tmp_path / "work"
    (w / "books").mkdir(parents=True)
    (w / "books" / "a.txt").write_text("It is a truth universally acknowledged. " * 200)
    (w / "notes.txt").write_text("not a folder\n")
    (w / "gone").symlink_to(w / "nowhere")  # a link to nothing
    done = w / "runs" / "done"
    done.mkdir(parents=True)
    (done / "results.json").write_text(json.dumps({"finished": True, "after": {"512": {"ppl": 12.5}}}) + "\n")
    (done / "log.jsonl").write_text('{"event": "start"}\n{"event": "step", "step": 1}\n')
    (done / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    monkeypatch.chdir(w)
    for name, recipe_text in (("damaged", "model: [unclosed\n"),
                              ("other", _yaml(_set(_set(BASE, "train.lr", 0.5), "output.dir", "runs/other")))):
        run = w / "runs" / name  # finished runs whose own recipe.yaml is damaged / another recipe
        run.mkdir()
        for f in ("results.json", "log.jsonl"):
            (run / f).write_text((done / f).read_text())
        (run / "recipe.yaml").write_text(recipe_text)
    step = w / "runs" / "stopped" / "checkpoint-2"  # Trainer's layout, with ctxext's record
    step.mkdir(parents=True)
    saved = recipe_from_dict(_set(_set(BASE, "train.lr", 0.5), "output.dir", "runs/stopped")).to_dict()
    (step / "ctxext_state.json").write_text(json.dumps({"step": 2, "recipe": saved}))
    old = w / "runs" / "old" / "checkpoints" / "step-000002"  # ctxext's layout before Trainer
    old.mkdir(parents=True)
    (old / "state.json").write_text(json.dumps({"step": 2, "recipe": saved}))
    return w


@pytest.mark.parametrize("name, text, extra, expect", CASES, ids=[c[0] for c in CASES])
def test_finetune_refuses(work, capsys, name, text, extra, expect):
    recipe = work / "r.yaml"
    if text is None:
        text = _yaml(BASE)
    if isinstance(text, bytes):
        recipe.write_bytes(text)
    else:
        recipe.write_text(text)
    extra = list(extra)
    if extra[:1] == ["--recipe"]:
        argv = ["finetune", extra[1]]
    else:
        argv = ["finetune", "r.yaml", *extra]
    line = assert_refused(argv, capsys, work, expect)
    assert line.startswith("ctxext finetune: error: "), line
    if name == "several-wrong-types":  # every bad key, each with its path, in one line
        for part in ("train.steps: input should be a valid integer, unable to parse string as an integer, got 'abc'", "lora.r: input should be a valid integer, unable to parse string as an integer, got 'many'",
                     "train.lr: input should be a valid number, unable to parse string as a number, got 'fast'"):
            assert part in line, line
    if name == "set-and-recipe-errors-together":
        assert "train.steps:" in line and "lora.r:" in line, line
    if name == "resume-changed-recipe":
        assert "the recipe changed" in line and "the recipe changed (train.lr: 0.5 -> 0.0002)" in line, line
    if name == "bad-scheduler-and-dropout":
        assert "train.scheduler" in line and "lora.dropout" in line, line


def test_at_least_a_dozen_cases():
    assert len(CASES) >= 12


# ----------------------------------------------------------------------------------- shipped recipes, paths


@pytest.mark.parametrize("recipe", TINY, ids=[p.stem for p in TINY])
def test_tiny_recipe_checks_from_anywhere(recipe, tmp_path, monkeypatch, capsys):
    """--check passes from a folder outside the checkout; the recipe names only shipped model and text."""
    text = recipe.read_text()
    assert "shared/" not in text and "reference:train" in text
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / recipe.name  # a copy away from the checkout: nothing relative to the repository is needed
    copy.write_text(text)
    capsys.readouterr()
    assert main(["finetune", str(copy), "--check"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["checked_architecture"]
    assert list(tmp_path.iterdir()) == [copy]  # --check writes nothing


@pytest.mark.parametrize("name", ["reference:LLAMA", "ctxext.reference:llama"])
def test_a_recipe_names_a_reference_model_as_the_other_commands_do(name, tmp_path, monkeypatch, capsys):
    """The recipe check and the loader share one resolver (ctxext.reference.model_source): a spelling that eval,
    export and search take is not refused by --check (it was: case-sensitive, and ctxext.reference: unknown)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("words " * 200)
    (tmp_path / "r.yaml").write_text(_yaml(_set(BASE, "model.name", name)))
    capsys.readouterr()
    assert main(["finetune", "r.yaml", "--check"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_the_run_checks_a_ctxext_reference_name_as_the_check_does():
    """check_model_sources with hub=True (what a run calls) sent ctxext.reference:llama to the hub."""
    from ctxext.finetune.config import ModelConfig, check_model_sources

    problems = []
    check_model_sources(ModelConfig(name="ctxext.reference:llama"), lambda message, key=None: problems.append(message),
                        hub=True)
    assert problems == []


def test_a_finished_runs_results_keep_their_numbers(work):
    """JSON read as YAML gave 2e-05 back as a string: --resume on a finished run returns its results as written."""
    from ctxext.finetune import run

    done = work / "runs" / "done"
    (done / "results.json").write_text('{"lr": 2e-05, "ppl": 1e+20}\n')
    recipe = recipe_from_dict(_set(BASE, "output.dir", str(done)), source=str(work / "r.yaml"))
    assert run(recipe, resume=True, progress=False) == {"lr": 2e-05, "ppl": 1e20}


def test_shipped_training_text():
    from ctxext.reference import TRAIN_BOOKS, data_files, training_files, training_texts

    meta = json.loads((REPO / "ctxext" / "assets" / "reference" / "training.json").read_text())
    assert [f"{b}.txt" for b in TRAIN_BOOKS] == meta["data"]["train_books"]
    files = training_files()
    assert [f.name for f in files] == [f"{b}.txt.xz" for b in TRAIN_BOOKS]
    assert sum(f.stat().st_size for f in files) < 1_200_000  # about 0.95 MB compressed
    texts = training_texts()
    assert len(texts) == 5 and 3_000_000 < sum(map(len, texts)) < 3_300_000
    assert texts[3].lstrip().startswith("PRIDE AND PREJUDICE") or "Bennet" in texts[3][:5000]
    assert data_files("emma")[0].name == "emma.txt.xz"
    with pytest.raises(ValueError, match="unknown shipped text"):
        data_files("dickens")


def test_relative_paths_read_from_the_recipe_folder(tmp_path, monkeypatch):
    """Data paths in a recipe file are relative to its folder (whatever the working directory); paths given with
    --set are relative to the working directory; output.dir is relative to the working directory."""
    from ctxext.finetune import load_recipe

    (tmp_path / "proj" / "data").mkdir(parents=True)
    (tmp_path / "proj" / "data" / "a.txt").write_text("words " * 100)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "b.txt").write_text("more words " * 100)
    recipe = tmp_path / "proj" / "r.yaml"
    recipe.write_text(_yaml(_set(BASE, "data.files", ["data/a.txt"])))
    monkeypatch.chdir(tmp_path / "elsewhere")
    r = load_recipe(recipe)
    assert r.data_paths(r.data.files, "data.files") == [tmp_path / "proj" / "data" / "a.txt"]
    r = load_recipe(recipe, ["data.files=[b.txt, reference:train]"])
    paths = r.data_paths(r.data.files, "data.files")
    assert paths[0] == tmp_path / "elsewhere" / "b.txt" and len(paths) == 6
    assert r.output.dir == "runs/new"  # output.dir stays as written: relative to where the run is started
    # the copy saved in output.dir holds absolute data paths, so it reads the same data from its new folder
    saved = yaml.safe_load(load_recipe(recipe).to_yaml(absolute_paths=True))
    assert saved["data"]["files"] == [str(tmp_path / "proj" / "data" / "a.txt")]
    assert saved["eval"]["data"] == "reference"


def test_xz_text_and_exclude_by_plain_name(tmp_path):
    import lzma

    from ctxext.data.textfiles import read_text
    from ctxext.finetune.data import expand_files

    with lzma.open(tmp_path / "a.txt.xz", "wt") as f:
        f.write("compressed words")
    (tmp_path / "b.txt").write_text("plain words")
    (tmp_path / "c.bin").write_bytes(b"\x00")
    files = expand_files([tmp_path], [])
    assert [f.name for f in files] == ["a.txt.xz", "b.txt"]
    assert read_text(files[0]) == "compressed words"
    assert [f.name for f in expand_files([tmp_path], ["a.txt"])] == ["b.txt"]  # pattern matches without .xz


@pytest.mark.slow
def test_tiny_recipes_check_from_an_installed_wheel(tmp_path):
    """Build the wheel, install it (no deps) into a fresh venv, and --check every tiny recipe from outside the
    checkout: the shipped model and text are found in the installed package (about 30 s)."""
    import subprocess

    wheels = tmp_path / "w"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "-w", str(wheels), "--no-deps", "-q"],
                   check=True, capture_output=True)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    py = venv / "bin" / "python"
    (wheel,) = wheels.glob("ctxext-*.whl")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, capture_output=True)
    run_dir = tmp_path / "outside"
    run_dir.mkdir()
    where = subprocess.run([str(py), "-c", "import ctxext; print(ctxext.__file__)"], cwd=run_dir, text=True,
                           capture_output=True, check=True).stdout
    assert str(venv) in where, where
    for recipe in TINY:
        copy = run_dir / recipe.name
        copy.write_text(recipe.read_text())
        proc = subprocess.run([str(py), "-m", "ctxext", "finetune", copy.name, "--check"], cwd=run_dir, text=True,
                              capture_output=True)
        assert proc.returncode == 0, (recipe.name, proc.stderr[-2000:])
        assert json.loads(proc.stdout)["checked_architecture"]
