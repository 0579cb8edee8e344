"""lm-eval integration: the `ctxext` model type on a local task (offline)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from test_eval_fixtures import CORPUS, save_tiny_llama

TASK = """\
task: ctxext_tiny_{kind}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{text}"
doc_to_target: "{target}"
metric_list:
{metrics}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("lm") / "llama")


@pytest.fixture
def tasks(tmp_path):
    text = CORPUS.read_text()
    docs = [{"context": text[i : i + 200], "continuation": text[i + 200 : i + 230], "text": text[i : i + 1500]}
            for i in range(0, 4500, 1500)]
    data = tmp_path / "docs.json"
    data.write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "loglik.yaml").write_text(TASK.format(
        kind="loglikelihood", data=data, text="{{context}}", target="{{continuation}}",
        metrics="  - metric: perplexity\n    aggregation: perplexity\n    higher_is_better: false\n"))
    (folder / "rolling.yaml").write_text(TASK.format(
        kind="loglikelihood_rolling", data=data, text="", target="{{text}}",
        metrics="  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"))
    return folder


def test_model_type_patches_and_advertises_the_patched_length(model_dir):
    import lm_eval.api.registry as registry

    import ctxext.integrations.lm_eval as m

    assert registry.get_model("ctxext") is m.CtxextLM
    lm = m.CtxextLM(pretrained=str(model_dir), method="yarn", factor=4, beta_fast=16, device="cpu")
    assert lm.max_length == 256  # 4 x the original 64
    assert lm.ctxext_spec["method"] == "yarn" and lm.ctxext_spec["options"]["beta_fast"] == 16.0
    plain = m.CtxextLM(pretrained=str(model_dir), device="cpu")
    assert plain.max_length == 64 and plain.ctxext_spec is None
    with pytest.raises(ValueError, match="without method"):
        m.CtxextLM(pretrained=str(model_dir), beta_fast=16, device="cpu")
    # model_args from a dict may be strings: a number-like factor is converted before ctxext.patch (numbers only)
    args = {"pretrained": str(model_dir), "method": "pi", "factor": "2"}
    lm = m.CtxextLM.create_from_arg_obj(args, {"device": "cpu"})
    assert lm.ctxext_spec["factor"] == 2.0 and lm.max_length == 128


def test_ctxext_lm_eval_command_on_a_local_task(model_dir, tasks, tmp_path, capsys, monkeypatch):
    import multiprocessing

    import lm_eval.api.metrics as metrics

    from ctxext.cli import main

    # lm-eval's bootstrap Pool must not fork this threaded process (a forked worker once hung CI for 11 minutes)
    start_methods, bootstrap = [], metrics.bootstrap_stderr

    def spy(*args, **kwargs):
        start_methods.append(multiprocessing.get_start_method(allow_none=True))
        return bootstrap(*args, **kwargs)

    monkeypatch.setattr(metrics, "bootstrap_stderr", spy)
    monkeypatch.delenv("DISABLE_MULTIPROC", raising=False)
    before = multiprocessing.get_start_method(allow_none=True)
    out = tmp_path / "out"
    rc = main(["lm-eval", "--model", "ctxext", "--model_args",
               f"pretrained={model_dir},method=yarn,factor=4,dtype=float32", "--device", "cpu",
               "--tasks", "ctxext_tiny_loglikelihood,ctxext_tiny_loglikelihood_rolling", "--include_path", str(tasks),
               "--output_path", str(out), "--batch_size", "1"])
    assert rc == 0
    (result_file,) = out.rglob("results*.json")
    results = json.loads(result_file.read_text())
    assert results["results"]["ctxext_tiny_loglikelihood"]["perplexity,none"] > 1
    assert results["results"]["ctxext_tiny_loglikelihood_rolling"]["word_perplexity,none"] > 1
    assert results["config"]["ctxext_patch"]["method"] == "yarn"
    assert results["config"]["ctxext_patch"]["patched_length"] == 256
    assert start_methods and set(start_methods) == {"forkserver"}
    assert multiprocessing.get_start_method(allow_none=True) == before  # the process's own setting is put back


@pytest.mark.skipif(not {"fork", "forkserver"} <= set(__import__("multiprocessing").get_all_start_methods()),
                    reason="fork and forkserver are POSIX start methods")
@pytest.mark.parametrize("chosen, during", [(None, "forkserver"), ("fork", "forkserver"), ("spawn", "spawn")])
def test_lm_eval_runs_its_pool_without_forking_a_threaded_process(chosen, during):
    import multiprocessing

    from ctxext.integrations.lm_eval_run import pool_start_method_safe_after_threads

    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method(chosen, force=True)
    try:
        with pool_start_method_safe_after_threads():
            assert multiprocessing.get_start_method(allow_none=True) == during
        assert multiprocessing.get_start_method(allow_none=True) == chosen
    finally:
        multiprocessing.set_start_method(before, force=True)


@pytest.mark.slow
def test_ruler_niah_single_1_offline(model_dir, tmp_path, monkeypatch):
    """RULER's niah_single_1 builds its haystack locally (repeated text): it runs offline once lm-eval's
    `ruler` extra (wonderwords, nltk) is installed. A random tiny model scores about 0."""
    assert 0 <= _niah_single_1_at_512(f"pretrained={model_dir},method=yarn,factor=8", 2, tmp_path, monkeypatch) <= 1


def _niah_single_1_at_512(model_args: str, limit: int, tmp_path, monkeypatch) -> float:
    """`ctxext lm-eval` on RULER's niah_single_1 at 512 tokens, offline; its score from the results file."""
    pytest.importorskip("wonderwords")
    pytest.importorskip("nltk")
    from ctxext.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "out"
    rc = main(["lm-eval", "--model", "ctxext", "--model_args", model_args, "--device", "cpu", "--tasks",
               "niah_single_1", "--metadata", '{"max_seq_lengths":[512]}', "--limit", str(limit),
               "--output_path", str(out), "--batch_size", "1"])
    assert rc == 0
    (result_file,) = out.rglob("results*.json")
    return json.loads(result_file.read_text())["results"]["niah_single_1"]["512,none"]


# -- RULER tasks on a GGUF model: lm-eval's samples need a tokenizer it can load -----------------------------------


def test_ruler_tasks_on_a_gguf_model_get_the_gguf_tokenizer_once(tmp_path, monkeypatch):
    """lm-eval's RULER builders load ``AutoTokenizer.from_pretrained(pretrained)``, which cannot read a GGUF's
    tokenizer: for RULER tasks on a GGUF model, ctxext saves that tokenizer once and names it in the metadata."""
    import transformers

    from ctxext.integrations import lm_eval_ruler as ruler
    from ctxext.reference import reference_tokenizer

    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "m.gguf").write_bytes(b"GGUF stand-in")
    calls = []
    tokenizer = reference_tokenizer()  # the GGUF's tokenizer, as transformers would read it

    def from_pretrained(name, **kwargs):
        calls.append((name, kwargs))
        return tokenizer

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    args = {"pretrained": str(tmp_path / "model"), "gguf_file": "m.gguf"}
    folder = ruler.ruler_tokenizer(args, "niah_single_1,ruler_vt", {})
    assert calls == [(str(tmp_path / "model"), {"gguf_file": "m.gguf"})]
    monkeypatch.undo()  # transformers' own loader again
    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    assert transformers.AutoTokenizer.from_pretrained(folder)("hello").input_ids == tokenizer("hello").input_ids
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    assert ruler.ruler_tokenizer(args, ["ruler"], {}) == folder and len(calls) == 1  # saved once, reused
    assert not [p for p in (tmp_path / "cache" / "gguf-tokenizers").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("args,tasks,metadata", [
    ({"pretrained": "DIR", "gguf_file": "m.gguf"}, "hellaswag,arc_easy", {}),  # no RULER task
    ({"pretrained": "DIR"}, "niah_single_1", {}),  # not a GGUF model: lm-eval loads its tokenizer itself
    ({"pretrained": "DIR", "gguf_file": "m.gguf"}, "niah_single_1", {"tokenizer": "gpt2"}),  # the user's choice
])
def test_other_runs_get_no_tokenizer_and_nothing_written(tmp_path, monkeypatch, args, tasks, metadata):
    from ctxext.integrations import lm_eval_ruler as ruler

    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(tmp_path / "cache"))
    assert ruler.ruler_tokenizer(args, tasks, metadata) is None
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_ruler_niah_single_1_on_the_smollm2_gguf_offline(tmp_path, monkeypatch):
    """End to end on a real GGUF checkpoint, offline, without --metadata tokenizer=...: it runs and scores."""
    from conftest import smollm2_gguf

    gguf = smollm2_gguf()
    score = _niah_single_1_at_512(f"pretrained={gguf.parent},gguf_file={gguf.name}", 1, tmp_path, monkeypatch)
    assert 0 <= score <= 1


def test_the_gguf_tokenizer_falls_back_to_a_temporary_folder_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    import transformers

    from ctxext.integrations import lm_eval_ruler as ruler
    from ctxext.reference import reference_tokenizer

    blocked = tmp_path / "cache-is-a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("CTXEXT_CACHE_DIR", str(blocked))
    tokenizer = reference_tokenizer()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    folder = ruler.ruler_tokenizer({"pretrained": "org/model", "gguf_file": "m.gguf", "revision": "v2"},
                                     [{"task": "niah_single_1"}, "hellaswag,ruler_vt"], {})
    assert folder is not None and (Path(folder) / "tokenizer_config.json").is_file()
    assert blocked.read_text() == "not a folder"


@pytest.mark.slow
def test_a_configs_metadata_survives_the_gguf_tokenizer(tmp_path, monkeypatch):
    """lm-eval replaces a --config's metadata with the command line's: the tokenizer is added to the merged one."""
    from conftest import smollm2_gguf

    from ctxext.compat import lm_eval as lm_eval_compat
    from ctxext.integrations import lm_eval_checks as checks

    gguf = smollm2_gguf()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = tmp_path / "run.yaml"
    config.write_text("metadata:\n  max_seq_lengths: [8192]\n")
    monkeypatch.setattr("sys.argv", ["lm-eval", "run", "--config", str(config), "--model", "ctxext", "--model_args",
                                     f"pretrained={gguf.parent},gguf_file={gguf.name}", "--tasks", "niah_single_1"])
    parsed = lm_eval_compat.harness_cli()().parse_args()
    checks.precheck(parsed)
    assert parsed.metadata["max_seq_lengths"] == [8192] and Path(parsed.metadata["tokenizer"]).is_dir()
