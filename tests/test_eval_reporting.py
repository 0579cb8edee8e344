"""Results a researcher can report (issue 46, part 4): the verdicts are in the results JSON, every row records the
settings its method ran with, the perplexity plot marks only measured points and draws what the verdict ranks by,
and each heatmap cell says how many samples it holds."""

from __future__ import annotations

import json

import pytest
import torch

import ctxext
from ctxext.cli import main
from ctxext.methods.remap import suggest_self_extend
from ctxext.reference import reference_model

TRAINED = 128  # the shipped LLaMA reference's training length


def _ids(n: int = 300) -> torch.Tensor:
    return torch.randint(0, 100, (1, n), generator=torch.Generator().manual_seed(0))


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# -- the results JSON ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def self_extend_run(tmp_path_factory):
    """One small offline run on the shipped reference: unpatched and self-extend (its defaults) at 1x and 4x."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("run") / "r.json"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = main(["eval", "--no-progress", "--device", "cpu", "--model", "reference:llama", "--lengths", "128,512",
                   "--methods", "none,self-extend:4", "--max-windows", "1", "--output", str(out),
                   "--plot", str(out.with_suffix(".png"))])
    assert rc == 0
    return json.loads(out.read_text()), stdout.getvalue()


def test_the_results_json_holds_the_verdicts_it_printed(self_extend_run):
    doc, printed = self_extend_run
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("verdict ("))
    shown = [line[2:] for line in lines[start + 1:] if line.startswith("  ")]
    assert shown and doc["verdicts"] == shown
    assert doc["verdicts"][0].startswith("llama: unpatched")


def test_rows_record_the_group_and_window_self_extend_ran_with(self_extend_run):
    doc, _ = self_extend_run
    group, window = suggest_self_extend(TRAINED, 4 * TRAINED)
    rows = [r for r in doc["results"] if r["method"] == "self-extend"]
    assert rows and all(r["spec"]["options"] == {"group": group, "window": window} for r in rows)
    assert doc["models"][0]["methods"]["self-extend x4"]["options"] == {"group": group, "window": window}


def test_the_recorded_options_re_applied_give_the_same_patch(self_extend_run):
    (row,) = [r for r in self_extend_run[0]["results"] if r["method"] == "self-extend" and r["length"] == 512]
    recorded = row["spec"]
    model, ids = reference_model("llama"), _ids()
    before = _logits(model, ids)
    ctxext.patch(model, "self-extend", 4)
    defaults = _logits(model, ids)
    ctxext.unpatch(model)
    assert torch.equal(_logits(model, ids), before)  # unpatch stays bit-exact
    ctxext.patch(model, recorded["method"], recorded["factor"], **recorded["options"])
    assert torch.equal(_logits(model, ids), defaults)
    assert ctxext.describe(model) == recorded
    assert not torch.equal(defaults, before)


# -- what describe and the saved record hold ------------------------------------------------------------------------


@pytest.mark.parametrize("method, factor, derived", [
    ("self-extend", 4, ("group", "window")),
    ("dca", 4, ("chunk_size", "local_window")),
    ("rerope", 4, ("window",)),
    ("lm-infinite", 4, ("window",)),
    ("streaming-llm", 4, ("window",)),
    ("string", 1.5, ("shift", "local")),
])
def test_describe_states_the_derived_settings_and_a_saved_record_reloads_to_the_same_patch(method, factor, derived,
                                                                                          tmp_path):
    model, ids = reference_model("llama"), _ids()
    before = _logits(model, ids)
    ctxext.patch(model, method, factor)
    spec = ctxext.describe(model)
    assert all(isinstance(spec["options"][k], int) for k in derived), spec
    patched = _logits(model, ids)
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())["ctxext"]
    assert saved["options"] == spec["options"]
    again = ctxext.from_pretrained(str(tmp_path / "saved"))
    assert ctxext.describe(again) == spec
    assert torch.equal(_logits(again, ids), patched)
    ctxext.unpatch(model)
    assert torch.equal(_logits(model, ids), before)
    assert model.config.to_dict() == reference_model("llama").config.to_dict()


def test_options_given_are_recorded_as_given():
    model = reference_model("llama")
    ctxext.patch(model, "self-extend", 4, group=4, window=16)
    assert ctxext.describe(model)["options"] == {"group": 4, "window": 16}
    ctxext.patch(model, "yarn", 4, replace=True)  # a method that derives nothing: its options as validated
    assert ctxext.describe(model)["options"]["attention_factor"] is None


# -- the perplexity plot ---------------------------------------------------------------------------------------------


def _ppl_rows():
    """llama trained to 192 (a length not measured); `none` cannot run at 512, yarn was not measured at 1024."""
    rows = []
    table = {"none": [10, 11, 30, None, 200], "yarn x4": [10.5, 10.8, 11, 12, "skip"],
             "self-extend x4": [10, 10.2, 10.4, 11, 12]}
    for label, values in table.items():
        for n, v in zip((64, 128, 256, 512, 1024), values):
            if v == "skip":
                continue
            row = {"kind": "ppl", "model": "llama", "label": label, "length": n}
            if v is None:
                row.update(ppl=None, not_applicable="cannot run")
            else:
                row.update(ppl=1.5 * v, ppl_last_quarter=v)
            rows.append(row)
    return rows


def _method_lines(ax) -> dict[str, list[list[tuple[float, float]]]]:
    out: dict[str, list] = {}
    for line in ax.get_lines():
        if line.get_gid():
            out.setdefault(line.get_gid(), []).append(list(zip(line.get_xdata(), line.get_ydata())))
    return out


def test_the_plot_marks_only_measured_points_and_draws_the_verdicts_measure():
    from ctxext.evaluation.pictures import plot_figure

    rows = _ppl_rows()
    fig = plot_figure(rows, [{"label": "llama", "original_length": 192}])
    top, bottom = fig.axes
    assert "last quarter" in top.get_ylabel() and "verdict" in top.get_title()
    assert "whole window" in bottom.get_ylabel()
    for ax, field in ((top, "ppl_last_quarter"), (bottom, "ppl")):
        lines = _method_lines(ax)
        value = {(r["label"], r["length"]): r.get(field) for r in rows}
        # no line across the unmeasured trained length (192), n/a (none at 512) or a length not measured (yarn 1024)
        assert lines == {
            "none": [[(64, value["none", 64]), (128, value["none", 128])], [(256, value["none", 256])],
                     [(1024, value["none", 1024])]],
            "yarn x4": [[(64, value["yarn x4", 64]), (128, value["yarn x4", 128])],
                        [(256, value["yarn x4", 256]), (512, value["yarn x4", 512])]],
            "self-extend x4": [[(64, value["self-extend x4", 64]), (128, value["self-extend x4", 128])],
                               [(n, value["self-extend x4", n]) for n in (256, 512, 1024)]],
        }
        assert all(line.get_marker() not in (None, "None", "") for line in ax.get_lines() if line.get_gid())
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert legend.count("none") == 1 and "none: cannot run" in legend  # one entry per method, however many pieces


def test_the_plot_without_last_quarter_values_draws_the_whole_window_alone(tmp_path):
    from ctxext.evaluation.pictures import plot_figure
    from ctxext.evaluation.report import plot

    rows = [{k: v for k, v in r.items() if k != "ppl_last_quarter"} for r in _ppl_rows()]
    (ax,) = plot_figure(rows, [{"label": "llama", "original_length": 128}]).axes
    assert "whole window" in ax.get_ylabel()
    assert _method_lines(ax)["none"] == [[(64, 15.0), (128, 16.5), (256, 45.0)], [(1024, 300.0)]]
    assert plot(rows, [{"label": "llama", "original_length": 128}], tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# -- the needle heatmap ----------------------------------------------------------------------------------------------


def _needle_row(kind, label, length, depths, trials):
    return {"kind": kind, "model": "m", "label": label, "length": length, "depths": depths, "trials": trials,
            "accuracy": sum(depths.values()) / len(depths)}


def test_heatmap_cells_say_how_many_samples_they_hold(tmp_path):
    from ctxext.evaluation.pictures import needle_cells, needle_figure
    from ctxext.evaluation.report import needle_depths, needle_heatmap

    # passkey: trials split evenly over the depths; a task: samples take the depths in turn (5 over 3: 2, 2, 1)
    passkey = [_needle_row("passkey", "none", 128, {"0": 1.0, "0.5": 0.5, "1": 0.0}, 6)]
    assert needle_cells(passkey) == {("m", "none"): {(0.0, 128): (1.0, 2), (0.5, 128): (0.5, 2),
                                                     (1.0, 128): (0.0, 2)}}
    tasks = [_needle_row("niah_single_1", "none", 128, {"0": 1.0, "0.5": 0.5, "1": 0.0}, 5),
             _needle_row("niah_single_2", "none", 128, {"0": 0.5, "0.5": 0.0, "1": 1.0}, 5)]
    cells = needle_cells(passkey + tasks)[("m", "none")]
    assert cells == {(0.0, 128): (0.75, 4), (0.5, 128): (0.25, 4), (1.0, 128): (0.5, 2)}
    assert needle_depths(passkey + tasks) == {("m", "none"): {k: v for k, (v, _) in cells.items()}}
    fig = needle_figure(passkey + tasks, [{"label": "m", "original_length": 128}])
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == ["25%\nn=4", "50%\nn=2", "75%\nn=4"]
    path = needle_heatmap(passkey, [{"label": "m", "original_length": 128}], tmp_path / "h.png")
    assert path.read_bytes()[:4] == b"\x89PNG"
