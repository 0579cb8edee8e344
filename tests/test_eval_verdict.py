"""The demo's verdict sentences and plot marks come from the numbers of the rows, never from fixed text."""

from __future__ import annotations

from ctxext.evaluation.report import cannot_run, plot
from ctxext.evaluation.verdict import format_verdicts, verdicts

MODELS = [{"label": "llama", "original_length": 256}, {"label": "gpt2", "original_length": 256},
          {"label": "bloom", "original_length": 256}]


def _rows(model, label, values, lengths=(256, 512, 1024, 2048), field="ppl_last_quarter"):
    out = []
    for n, v in zip(lengths, values):
        row = {"kind": "ppl", "model": model, "label": label, "length": n, "ppl": v}
        if v is None:
            row["not_applicable"] = "the position table has 256 rows"
        elif field:
            row[field] = v
        out.append(row)
    return out


def test_sentences_follow_the_numbers():
    rows = (_rows("llama", "none", [100, 150, 340, 900]) + _rows("llama", "yarn x8", [120, 115, 110, 125])
            + _rows("llama", "pi x8", [200, 190, 180, 185])
            + _rows("gpt2", "none", [160, None, None, None]) + _rows("gpt2", "pi x8", [159, 149, 145, 153])
            + _rows("bloom", "none", [130, 125, 118, 122]) + _rows("bloom", "nope", [226, 221, 216, 228]))
    got = verdicts(rows, MODELS)
    assert got == [
        "llama: unpatched fails past 512 (last-quarter perplexity x3.4 at 1024 = 4x); yarn x8 holds (x1.10 at 1024 = 4x)",
        "gpt2: unpatched cannot run past 256 positions; pi x8 holds (x0.91 at 1024 = 4x)",
        "bloom: unpatched holds (x0.91 at 1024 = 4x, x0.94 at 2048); no method beats unpatched at 1024 = 4x "
        "(best: nope x1.66)",
    ]
    assert format_verdicts(rows, MODELS).splitlines()[0].startswith("verdict")


def test_other_numbers_give_other_sentences():
    rows = _rows("llama", "none", [100, 110, 150, 300]) + _rows("llama", "yarn x8", [120, 130, 140, 200])
    assert verdicts(rows, MODELS[:1]) == [
        "llama: unpatched degrades (last-quarter perplexity x1.5 at 1024 = 4x); yarn x8 is best (x1.40 at 1024 = 4x)"]
    rows = _rows("llama", "none", [100, 230, 250, 300], field=None)  # no last-quarter values: whole-window perplexity
    assert verdicts(rows, MODELS[:1]) == ["llama: unpatched fails past 256 (perplexity x2.5 at 1024 = 4x)"]


def test_no_sentence_without_a_baseline_at_the_trained_length():
    # A model with rows but no verdict says why (issue 62, item 3: an empty list read as a silent failure)
    rows = _rows("llama", "yarn x8", [120, 115, 110, 125])
    assert verdicts(rows, MODELS) == [
        "llama: no verdict: no unpatched row at the trained length 256 (measure method none there)"]
    assert "llama: no verdict" in format_verdicts(rows, MODELS)


def test_no_verdict_without_a_length_past_the_trained_one():
    rows = _rows("llama", "none", [100], lengths=(256,)) + _rows("llama", "yarn x8", [120], lengths=(256,))
    assert verdicts(rows, MODELS) == ["llama: no verdict: no length past the trained 256"]
    assert verdicts([], MODELS) == [] and format_verdicts([], MODELS) == ""  # no rows: nothing to say


def test_passkey_is_added():
    # Passkey is read as the RULER-style tasks are (issue 24): at the headline length 4x, not the longest one.
    rows = _rows("llama", "none", [100, 110, 120, 130])
    rows += [{"kind": "passkey", "model": "llama", "label": lab, "length": n, "accuracy": a}
             for lab, n, a in (("none", 256, 1.0), ("none", 1024, 0.1), ("yarn x8", 1024, 0.8), ("none", 2048, 0.0),
                               ("yarn x8", 2048, 0.1))]
    assert verdicts(rows, MODELS[:1])[0].endswith(
        "; passkey at 1024 = 4x: unpatched 10% (100% at 256), best yarn x8 80%")


def test_passkey_names_a_method_that_holds_perplexity_but_misses_the_key():
    rows = (_rows("llama", "none", [100, 150, 340, 900]) + _rows("llama", "streaming-llm x8", [100, 96, 95, 97])
            + _rows("llama", "rerope x8", [105, 110, 112, 118]))
    rows += [{"kind": "passkey", "model": "llama", "label": lab, "length": n, "accuracy": a}
             for lab, n, a in (("none", 256, 1.0), ("none", 1024, 0.0), ("streaming-llm x8", 1024, 0.1),
                               ("rerope x8", 1024, 0.9))]
    sentence = verdicts(rows, MODELS[:1])[0]
    assert "passkey at 1024 = 4x: unpatched 0% (100% at 256), best rerope x8 90%" in sentence
    assert sentence.endswith("streaming-llm x8 holds perplexity (x0.95) but retrieves 10% at 1024 = 4x")
    assert "rerope x8 holds perplexity" not in sentence
    # a model that cannot find the key even at its trained length: no ranking, no blame
    rows = [r for r in rows if r.get("kind") != "passkey" or r["label"] != "none"]
    rows.append({"kind": "passkey", "model": "llama", "label": "none", "length": 256, "accuracy": 0.0})
    assert verdicts(rows, MODELS[:1])[0].endswith(
        "; passkey: unpatched scores 0% even at its trained length 256, too little to rank methods by")


def test_plot_marks_lengths_a_model_cannot_run(tmp_path):
    rows = _rows("gpt2", "none", [160, None, None, None]) + _rows("gpt2", "pi x8", [159, 149, 145, 153])
    assert cannot_run(rows) == {"none": [512, 1024, 2048]}
    path = plot(rows, MODELS[1:2], tmp_path / "p.png")
    assert path.stat().st_size > 10_000
