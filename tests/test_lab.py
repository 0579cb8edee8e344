"""`ctxext lab`: tiny decoders that differ only in position encoding (ctxext.lab)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from ctxext.cli import main
from ctxext.lab import run as lab_run
from ctxext.lab import shift as lab_shift
from ctxext.lab.data import (COPY_RANGE, IGNORE, SEP, copy_batch, copy_warmup_batches, training_batches,
                             warmup_spans)
from ctxext.lab.model import ModelConfig, build_model
from ctxext.lab.positions import SCHEMES, Alibi, Learned, Rope, alibi_slopes, sinusoidal_table, t5_bucket
from ctxext.lab.run import LabSettings, curve_note, run_lab, verdicts
from ctxext.lab.train import perplexity

TINY = LabSettings(train_len=16, d_model=32, n_layers=1, n_heads=4, d_ff=64, batch=4, steps=3, warmup=1,
                   factors=(1, 2), eval_windows=2, copy_seqs=4, copy_warmup=2)


@pytest.fixture(scope="module")
def lab_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    doc = run_lab(TINY, list(SCHEMES), out, plot=False, progress=False)
    return out, doc


# ------------------------------------------------------------------------------------------------ the lab run

def test_quick_lab_trains_and_evaluates_every_scheme(lab_out):
    out, doc = lab_out
    saved = json.loads((out / "lab.json").read_text())
    assert saved["schemes"] == list(SCHEMES)
    assert set(saved["results"]) == set(SCHEMES)
    for s in SCHEMES:
        res = saved["results"][s]
        assert res["train_seconds"] > 0 and math.isfinite(res["final_train_loss"])
        one = res["lengths"]["1x"]
        assert one["length"] == 16
        assert math.isfinite(one["ppl"]) and math.isfinite(one["ppl_last_quarter"]) and 0 <= one["copy_accuracy"] <= 1
        assert (out / "models" / f"{s}.pt").exists()
        if s != "learned":
            assert math.isfinite(res["lengths"]["2x"]["ppl"])
    # the learned table has exactly 16 rows: 2x is reported as "cannot run", not a crash or NaN
    two = saved["results"]["learned"]["lengths"]["2x"]
    assert "ppl" not in two and "cannot run past its 16 positions" in two["cannot_run"]
    md = (out / "lab.md").read_text()
    assert "cannot run" in md and "| alibi |" in md
    assert "1x copy accuracy during training" in md and "(steps 3, 4, 5)" in md
    assert saved["machine"]["torch"] == torch.__version__ and saved["machine"]["cpu_count"]
    assert saved["verdicts"] == verdicts(saved["results"], 16)


def test_learning_curve_is_recorded_and_ends_at_the_1x_copy_accuracy(lab_out):
    _, doc = lab_out
    for s in SCHEMES:
        res = doc["results"][s]
        curve = res["copy_curve"]
        assert [p["step"] for p in curve] == [3, 4, 5]  # curve_points 5 capped at the 3 mixed steps, after 2 warm-up
        assert all(0 <= p["copy_accuracy"] <= 1 for p in curve)
        # the last checkpoint is the trained model on the 1x evaluation's sequences
        assert curve[-1]["copy_accuracy"] == res["lengths"]["1x"]["copy_accuracy"]


def test_parallel_jobs_give_the_serial_numbers(lab_out, tmp_path):
    """run_lab(jobs=2) trains the schemes in spawned worker processes and gets what the serial run got."""
    _, serial = lab_out
    doc = run_lab(TINY, ["rope", "alibi"], tmp_path, plot=False, progress=False, jobs=2)
    for s in ("rope", "alibi"):
        a, b = doc["results"][s], serial["results"][s]
        assert a["lengths"] == b["lengths"] and a["copy_curve"] == b["copy_curve"]
        assert a["final_train_loss"] == b["final_train_loss"]
        assert (tmp_path / "models" / f"{s}.pt").is_file()
    with pytest.raises(ValueError, match="jobs must be a positive integer"):
        run_lab(TINY, ["rope"], tmp_path / "x", plot=False, progress=False, jobs=0)
    assert not (tmp_path / "x").exists()


def test_existing_result_is_not_overwritten(lab_out, monkeypatch):
    out, _ = lab_out
    before = (out / "lab.json").read_bytes()
    monkeypatch.setattr(lab_run, "corpus", lambda: pytest.fail("trained although the result exists"))
    with pytest.raises(ValueError, match="--overwrite"):
        run_lab(TINY, ["alibi"], out, plot=False, progress=False)
    assert main(["lab", "--out", str(out), "--schemes", "alibi", "--no-plot"]) == 2
    assert (out / "lab.json").read_bytes() == before


def test_overwrite_replaces_the_result(tmp_path):
    (tmp_path / "lab.json").write_text(json.dumps({"settings": dataclasses.asdict(TINY)}))  # an earlier run's
    run_lab(dataclasses.replace(TINY, steps=1, factors=(1,)), ["nope"], tmp_path, overwrite=True, plot=False,
            progress=False)
    assert json.loads((tmp_path / "lab.json").read_text())["schemes"] == ["nope"]


@pytest.mark.parametrize("argv, message", [
    (["lab", "--schemes", "rope,bogus"], "unknown scheme"),
    (["lab", "--schemes", "rope,rope"], "twice"),
    (["lab", "--steps", "0"], "--steps"),
    (["lab", "--offsets", "0,16"], "--offsets"),
    (["lab", "shift", "--offsets", "0,x"], "integers"),
    (["lab", "shift", "--quick", "--offsets", "0,1000"], "exceeds the learned table"),
    (["lab", "--jobs", "0"], "--jobs"),
    (["lab", "shift", "--jobs", "2"], "--jobs goes with the lab itself"),
])
def test_bad_arguments_fail_before_training(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lab_run, "corpus", lambda: pytest.fail("trained despite bad arguments"))
    monkeypatch.setattr(lab_shift, "corpus", lambda: pytest.fail("trained despite bad arguments"))
    assert main(argv + ["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "o").exists()


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="heads"):
        LabSettings(d_model=30, n_heads=4).check()
    with pytest.raises(ValueError, match="steps"):
        LabSettings(steps=0).check()


def test_plot_is_written(tmp_path, lab_out):
    pytest.importorskip("matplotlib")
    from ctxext.lab.plot import plot_lab

    plot_lab(lab_out[1], tmp_path / "lab.png")
    assert (tmp_path / "lab.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------ verdicts

def _res(lq: dict, copy: dict | None = None):
    lengths = {}
    for f, v in lq.items():
        lengths[f"{f}x"] = ({"length": 64 * f, "cannot_run": "no"} if v is None else
                            {"length": 64 * f, "ppl": v, "ppl_last_quarter": v, "copy_accuracy": (copy or {}).get(f, 0.0)})
    return {"lengths": lengths}


def test_verdicts_come_from_the_numbers():
    res = {
        "learned": _res({1: 100, 2: None, 4: None, 8: None}),
        "rope": _res({1: 100, 2: 150, 4: 310, 8: 900}, copy={1: 0.9}),
        "sinusoidal": _res({1: 100, 2: 110, 4: 150, 8: 200}, copy={1: 0.9, 2: 0.9}),
        "alibi": _res({1: 100, 2: 99, 4: 101, 8: 105}, copy={1: 0.9}),
        "nope": _res({1: 100, 2: 300}, copy={1: 0.8, 2: 0.6}),
    }
    v = dict(line.split(":", 1) for line in verdicts(res, 64))
    assert "cannot run past 64 positions (held" in v["learned"]
    assert "x3.10 at 4x" in v["rope"] and "held" in v["rope"] and "NOT" not in v["rope"]
    assert "x1.50 at 4x" in v["sinusoidal"] and "NOT held" in v["sinusoidal"]
    assert "x1.05 at 8x" in v["alibi"] and "NOT" not in v["alibi"]
    assert "held, on copy" in v["nope"]
    res["alibi"] = _res({1: 100, 8: 400}, copy={1: 0.9})
    res["learned"] = _res({1: 100, 2: 120})
    res["nope"] = _res({1: 100, 2: 300}, copy={1: 0.8, 2: 0.1})
    v = dict(line.split(":", 1) for line in verdicts(res, 64))
    assert "x4.00 at 8x" in v["alibi"] and "NOT held" in v["alibi"]
    assert "NOT held" in v["learned"] and "NOT held" in v["nope"]
    # the recall form: perfect copying at 1x lost at 2x is degradation even where perplexity barely moves
    res["rope"] = _res({1: 100, 2: 110, 4: 120, 8: 130}, copy={1: 1.0, 2: 0.01})
    v = dict(line.split(":", 1) for line in verdicts(res, 64))
    assert "copy accuracy 1.00 at 1x -> 0.01 at 2x" in v["rope"] and "held, on copy" in v["rope"]
    res["rope"] = _res({1: 100, 2: 110, 4: 120, 8: 130}, copy={1: 1.0, 2: 0.5})
    assert "NOT held" in dict(line.split(":", 1) for line in verdicts(res, 64))["rope"]
    # a model that did not learn to read far context gets no verdict on extrapolation, only the numbers
    res["rope"] = _res({1: 100, 2: 150, 4: 310, 8: 900}, copy={1: 0.01})
    res["nope"] = _res({1: 100, 2: 105}, copy={1: 0.0, 2: 0.0})
    v = dict(line.split(":", 1) for line in verdicts(res, 64))
    assert "x3.10 at 4x" in v["rope"] and "inconclusive: copy accuracy 0.01 at 1x < 0.5" in v["rope"]
    assert "inconclusive" in v["nope"] and "would read held" in v["nope"]


# ------------------------------------------------------------------------------------------------ shift probe

def test_shift_changes_learned_and_leaves_alibi_unchanged():
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, train_len=64)
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 4096, (3, 17), generator=g)
    ppl = {}
    for s in ("learned", "alibi", "rope", "nope"):
        model = build_model(cfg, s, seed=0).eval()
        with torch.no_grad():  # make the position parts matter: larger than their init
            for name, p in model.named_parameters():
                if name.startswith("pe."):
                    p.mul_(25)
        ppl[s] = [perplexity(model, windows, offset=k)[0] for k in (0, 32)]
    assert abs(ppl["learned"][1] / ppl["learned"][0] - 1) > 1e-3
    assert ppl["alibi"][1] == pytest.approx(ppl["alibi"][0], rel=1e-4)
    assert ppl["rope"][1] == pytest.approx(ppl["rope"][0], rel=1e-3)
    assert ppl["nope"][1] == pytest.approx(ppl["nope"][0], rel=1e-6)


def test_shift_probe_writes_results(tmp_path):
    settings = dataclasses.replace(TINY, train_len=32, steps=2)
    doc = lab_shift.run_shift(tmp_path, settings=settings, schemes="learned,alibi", window=8, offsets=[0, 8, 24],
                              n_windows=2, plot=False, progress=False)
    saved = json.loads((tmp_path / "shift.json").read_text())
    assert saved["offsets"] == [0, 8, 24] and saved["window"] == 8
    alibi = [r["ppl"] for r in saved["results"]["alibi"]]
    assert max(alibi) / min(alibi) - 1 < 1e-4
    assert any("alibi" in v and "held" in v for v in doc["verdicts"])
    with pytest.raises(ValueError, match="--overwrite"):
        lab_shift.run_shift(tmp_path, settings=settings, schemes="alibi", plot=False, progress=False)


def test_shift_refuses_to_train_silently_when_lab_models_are_missing(lab_out, monkeypatch, tmp_path):
    out = tmp_path / "o"
    (out / "models").mkdir(parents=True)
    (out / "models" / "settings.json").write_text(json.dumps({"settings": dataclasses.asdict(TINY)}))
    monkeypatch.setattr(lab_shift, "corpus", lambda: pytest.fail("trained although models were missing"))
    with pytest.raises(ValueError, match="lack learned"):
        lab_shift.run_shift(out, schemes="learned", plot=False, progress=False)


def test_shift_reuses_lab_models(lab_out, tmp_path):
    out, _ = lab_out
    doc = lab_shift.run_shift(out, schemes="learned,alibi", window=4, offsets=[0, 12], n_windows=2, plot=False,
                              progress=False)
    assert doc["reused_lab_models"] and doc["settings"]["train_len"] == 16


# ------------------------------------------------------------------------------------------------ definitions

def test_alibi_bias_is_minus_slope_times_distance():
    assert alibi_slopes(4).tolist() == [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
    assert alibi_slopes(8).tolist() == [2 ** (-i) for i in range(1, 9)]
    n = 8
    pos = torch.arange(5, 12)
    bias = Alibi(n).bias(pos)
    for h in range(n):
        for i in range(7):
            for j in range(7):
                assert bias[h, i, j].item() == pytest.approx(-(2 ** (-8 * (h + 1) / n)) * (i - j))
    assert torch.equal(bias, Alibi(n).bias(pos - 5))


def test_rope_score_depends_only_on_the_distance():
    rope = Rope(16)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(m, n):
        qm, _ = rope.rotate(q, q, torch.tensor([m]))
        _, kn = rope.rotate(k, k, torch.tensor([n]))
        return float((qm * kn).sum())

    assert score(7, 3) == pytest.approx(score(107, 103), rel=1e-4)
    assert score(7, 3) == pytest.approx(score(4, 0), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    # rotation keeps norms
    qm, _ = rope.rotate(q, q, torch.tensor([50]))
    assert float(qm.norm()) == pytest.approx(float(q.norm()), rel=1e-5)


def test_sinusoidal_and_learned_tables():
    pe = sinusoidal_table(torch.arange(10), 8)
    for p in range(10):
        for i in range(4):
            assert pe[p, 2 * i].item() == pytest.approx(math.sin(p / 10000 ** (2 * i / 8)), abs=1e-6)
            assert pe[p, 2 * i + 1].item() == pytest.approx(math.cos(p / 10000 ** (2 * i / 8)), abs=1e-6)
    table = Learned(8, 16)
    table.embed(torch.zeros(1, 16, 8), torch.arange(16))
    with pytest.raises(ValueError, match="cannot run past its 16 positions"):
        table.embed(torch.zeros(1, 17, 8), torch.arange(17))


def test_t5_buckets():
    rel = torch.arange(0, 1000)
    b = t5_bucket(rel, 32, 128)
    assert torch.equal(b[:16], torch.arange(16))
    assert bool((b[1:] >= b[:-1]).all()) and int(b.max()) == 31 and int(b[128]) == 31


def test_schemes_share_everything_but_the_position_encoding():
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, d_ff=64, train_len=16)
    ref = {k: v for k, v in build_model(cfg, "nope").state_dict().items()}
    for s in SCHEMES:
        sd = build_model(cfg, s).state_dict()
        assert {k for k in sd if not k.startswith("pe.")} == set(ref)
        assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_inconclusive_verdict_shows_whether_the_curve_still_rises():
    def curve(*acc):
        return [{"step": 100 * (i + 1), "copy_accuracy": a} for i, a in enumerate(acc)]

    assert "still rising" in curve_note(curve(0.0, 0.05, 0.1, 0.2, 0.3)) and "0.10 -> 0.20 -> 0.30" in \
        curve_note(curve(0.0, 0.05, 0.1, 0.2, 0.3))
    assert "flat" in curve_note(curve(0.0, 0.01, 0.0, 0.01, 0.0)) and "rising" not in curve_note(curve(0, 0, 0, 0, 0))
    assert "flat" in curve_note(curve(0.1, 0.3, 0.2, 0.2, 0.21))  # below an earlier point: not rising
    assert curve_note([]) == "" and curve_note(None) == ""
    res = {"alibi": _res({1: 100, 2: 99, 4: 101, 8: 105}, copy={1: 0.3})}
    res["alibi"]["copy_curve"] = curve(0.0, 0.1, 0.2, 0.25, 0.3)
    (v,) = verdicts(res, 64)
    assert "inconclusive" in v and "still rising" in v and "0.20 -> 0.25 -> 0.30 (steps 100, 200, 300, 400, 500)" in v
    res["alibi"]["copy_curve"] = curve(0.0, 0.0, 0.0, 0.0, 0.0)
    (v,) = verdicts(res, 64)
    assert "inconclusive" in v and "curve flat" in v
    res["alibi"] = _res({1: 100, 2: 99, 4: 101, 8: 105}, copy={1: 0.9})
    res["alibi"]["copy_curve"] = curve(0.0, 0.5, 0.9)
    (v,) = verdicts(res, 64)
    assert "inconclusive" not in v and "curve" not in v  # a judged claim needs no curve


def test_copy_warmup_rows_are_single_units_of_growing_span():
    """The warm-up's rows are each one copy unit [SEP x SEP x], as long as the unit, with only the copy scored;
    the span runs 8, 16, ... below the full span, then the full span, in equal stages."""
    assert warmup_spans(128) == [8, 16, 32, 63]
    assert warmup_spans(64) == [8, 16, 31]
    assert warmup_spans(16) == [7]
    batches = list(copy_warmup_batches(8, 3, 64, seed=0))
    spans = [(ids.shape[1] - 2) // 2 for ids, _ in batches]
    assert spans == [8, 8, 8, 16, 16, 16, 31, 31]
    for ids, tgt in batches:
        L = (ids.shape[1] - 2) // 2
        assert ids.shape == tgt.shape == (3, 2 * L + 2)
        assert (ids[:, 0] == SEP).all() and (ids[:, L + 1] == SEP).all()
        assert torch.equal(ids[:, 1:L + 1], ids[:, L + 2:])
        assert torch.equal(tgt[:, L + 1:2 * L + 1], ids[:, L + 2:])
        assert (tgt[:, :L + 1] == IGNORE).all() and (tgt[:, 2 * L + 1:] == IGNORE).all()
    assert list(copy_warmup_batches(0, 3, 64, seed=0)) == []


def test_copy_warmup_comes_first_and_leaves_the_mixed_batches_unchanged(monkeypatch):
    """train_model runs the warm-up's batches, then exactly the mixed batches a run without warm-up sees, and
    counts the curve's steps from the start of the warm-up."""
    from ctxext.lab import train as lab_train

    seen = []
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, d_ff=64, train_len=16)
    model = build_model(cfg, "nope", seed=0)
    real_forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, ids, position_ids=None: (
        seen.append(ids.clone()) or real_forward(self, ids, position_ids)))
    steps_at = []
    lab_train.train_model(model, torch.arange(5000) % 4096, steps=3, batch=4, length=16, lr=1e-3, warmup=1, seed=5,
                          copy_warmup=2, checkpoint=lambda m, step: steps_at.append(step), checkpoints=3)
    warm = list(copy_warmup_batches(2, 4, 16, seed=6))
    mixed = list(training_batches(torch.arange(5000) % 4096, 3, 4, 16, 5, 0.5))
    assert len(seen) == 5  # 2 warm-up + 3 mixed steps, one forward each (this checkpoint runs no model)
    train_ids = seen
    assert [tuple(x.shape) for x in train_ids[:2]] == [(4, 16), (4, 16)]  # span 7 = the full span at length 16
    assert torch.equal(train_ids[0], warm[0][0]) and torch.equal(train_ids[1], warm[1][0])
    assert all(torch.equal(x, y[0]) for x, y in zip(train_ids[2:], mixed))
    assert steps_at == [3, 4, 5]


def test_decoder_sinusoidal_table_matches_the_token_scale():
    """The decoder's sinusoidal table is the paper's table times TOKEN_INIT_STD * sqrt(2) (entry RMS = token std);
    the encoder keeps the unscaled table."""
    from ctxext.lab.model import TOKEN_INIT_STD
    from ctxext.lab.positions import sinusoidal_table

    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=4, d_ff=64, train_len=16)
    dec = build_model(cfg, "sinusoidal", seed=0)
    x = torch.zeros(1, 16, 32)
    pos = torch.arange(16)
    got = dec.pe.embed(x, pos)[0]
    assert torch.allclose(got, TOKEN_INIT_STD * math.sqrt(2) * sinusoidal_table(pos, 32), atol=0, rtol=1e-6)
    assert abs(float(got.pow(2).mean().sqrt()) - TOKEN_INIT_STD) < 0.002
    assert abs(float(dec.tok.weight.detach().std()) - TOKEN_INIT_STD) < 0.002
    from ctxext.lab.encoder import TinyEncoder
    enc = TinyEncoder(cfg, "sinusoidal")
    d = enc.pe.dim
    assert torch.equal(enc.pe.embed(torch.zeros(1, 4, d), torch.arange(4))[0], sinusoidal_table(torch.arange(4), d))


def test_copy_batch_scores_only_the_copy():
    ids, tgt = copy_batch(3, 20, torch.Generator().manual_seed(0))
    assert ids.shape == tgt.shape == (3, 20)
    L = 9
    assert (ids[:, 0] == SEP).all() and (ids[:, L + 1] == SEP).all()
    assert torch.equal(ids[:, 1:L + 1], ids[:, L + 2:2 * L + 2])
    assert ((ids[:, 1:L + 1] >= COPY_RANGE[0]) & (ids[:, 1:L + 1] < COPY_RANGE[1])).all()
    scored = tgt != IGNORE
    assert scored.sum(1).tolist() == [L] * 3
    assert torch.equal(tgt[:, L + 1:2 * L + 1], ids[:, L + 2:2 * L + 2])
