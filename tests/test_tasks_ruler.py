"""RULER-style tasks (ctxext.evaluation.tasks): generators, scorers, the task catalog, and the pipeline on an
oracle model that reads the prompt as text."""

from __future__ import annotations

import collections
import re

import pytest
import torch

from ctxext.evaluation.tasks import (TASKS, Encoder, check_length, generate, parse_tasks, sources, task_accuracy)
from ctxext.evaluation.tasks import ruler
from ctxext.evaluation.tasks.scoring import clean, match_all, match_part
from ctxext.evaluation.tasks.tokens import Haystack, insert_at_depths

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    from ctxext import reference

    return reference.reference_tokenizer("llama")


@pytest.fixture(scope="module")
def text():
    from ctxext import reference

    return reference.reference_text()[:200_000]


@pytest.fixture(scope="module")
def src(tokenizer, text):
    return sources(Encoder(tokenizer, chat_template=False), [text])


# -- scores ------------------------------------------------------------------------------------------------------

def test_match_all_counts_each_expected_string_case_blind():
    assert match_all(" The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert match_all("only 1234567", ["1234567", "7654321"]) == 0.5
    assert match_all("ABCDE, fghij", ["abcde", "FGHIJ", "KLMNO", "PQRST"]) == 0.5
    assert match_all("", ["x"]) == 0.0


def test_match_part_needs_any_one():
    assert match_part("it is paris", ["Paris", "London"]) == 1.0
    assert match_part("it is rome", ["Paris", "London"]) == 0.0


def test_clean_turns_control_characters_into_newlines():
    assert clean("\x00 123\t456 \x1f") == "123\n456"
    with pytest.raises(ValueError):
        match_all("x", [])


# -- the catalog -------------------------------------------------------------------------------------------------

def test_parse_tasks_expands_aliases_once_in_order():
    assert parse_tasks("ppl,quick,niah_single_1") == ["ppl", "niah_single_1", "niah_single_2", "niah_multikey_1", "vt"]
    assert parse_tasks("ruler") == list(TASKS) and len(TASKS) == 11
    assert parse_tasks("niah") == [n for n in TASKS if n.startswith("niah")]
    assert parse_tasks("NIAH-SINGLE-1, passkey") == ["niah_single_1", "passkey"]


@pytest.mark.parametrize("bad, said", [("bogus", "unknown task(s) 'bogus'"), ("vt,nope,zz", "'nope', 'zz'"),
                                       ("qa_1", "not offline"), (" , ", "no task given")])
def test_parse_tasks_refuses_with_the_known_names(bad, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        parse_tasks(bad)


# -- generators --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TASKS))
@pytest.mark.parametrize("length", [1024, 4096])
def test_every_sample_fills_the_length_exactly(src, name, length):
    sample = generate(TASKS[name], src, length, seed=3, index=1, depth=0.75)
    assert len(sample.ids) + sample.max_new_tokens == length
    assert sample.max_new_tokens <= TASKS[name].ruler_tokens
    assert sample.answers


@pytest.mark.parametrize("name", list(TASKS))
def test_samples_are_deterministic_by_seed_and_index(src, name):
    a = generate(TASKS[name], src, 1024, seed=0, index=2, depth=0.5)
    b = generate(TASKS[name], src, 1024, seed=0, index=2, depth=0.5)
    c = generate(TASKS[name], src, 1024, seed=1, index=2, depth=0.5)
    d = generate(TASKS[name], src, 1024, seed=0, index=3, depth=0.5)
    assert a.ids == b.ids and a.answers == b.answers
    assert a.ids != c.ids and a.ids != d.ids


def _facts(text: str) -> list[tuple[str, str]]:
    return re.findall(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.", text)


@pytest.mark.parametrize("name", [n for n in TASKS if n.startswith("niah")])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_needles_present_once_at_the_stated_depth(src, tokenizer, name, depth):
    length = 2048
    sample = generate(TASKS[name], src, length, seed=0, index=0, depth=depth)
    text = tokenizer.decode(sample.ids)
    facts = _facts(text)
    query = re.search(r"for (.+) mentioned in the provided text\?", text).group(1)
    keys = re.split(r", and |, ", query)
    for key in keys:
        values = [v for k, v in facts if k == key]
        assert len(values) == TASKS[name].options["v"]  # each needle of a queried key exactly once
    assert sorted(v for k, v in facts if k in keys) == sorted(sample.answers)
    for answer in sample.answers:
        assert text.count(answer) == 1
    assert abs(sample.depth - depth) < 0.05  # the nearest unit boundary to the stated depth
    # a needle of the first queried key sits near the stated depth of the prompt's text too
    spots = [m.start() / len(text) for m in re.finditer(re.escape(f"for {keys[0]} is:"), text)]
    assert min(abs(at - depth) for at in spots) < 0.15


def test_vt_chain_is_in_order_and_answers_follow_it(src, tokenizer):
    sample = generate(TASKS["vt"], src, 2048, seed=0, index=0)
    text = tokenizer.decode(sample.ids)
    first = re.search(rf"VAR {sample.answers[0]} = (\d+)", text)
    assert first and f"assigned the value {first.group(1)}" in text
    spots = [text.index(f"VAR {sample.answers[i]} = VAR {sample.answers[i - 1]}") for i in range(1, 5)]
    assert spots == sorted(spots) and spots[0] > first.start()


def test_cwe_answers_are_the_ten_most_common_words(src, tokenizer):
    sample = generate(TASKS["cwe"], src, 4096, seed=0, index=0)
    text = tokenizer.decode(sample.ids)
    listed = re.findall(r"\d+\. ([a-z]+)", text.split("\nQuestion:")[0])
    counts = collections.Counter(listed)
    top = [w for w, _ in counts.most_common(10)]
    assert sorted(top) == sorted(sample.answers)
    assert min(counts[w] for w in sample.answers) == 30  # RULER's counts at >= 4096 tokens (the last may be cut)
    assert max(c for w, c in counts.items() if w not in sample.answers) <= 3


def test_fwe_answers_are_the_second_to_fourth_most_frequent(src, tokenizer):
    sample = generate(TASKS["fwe"], src, 4096, seed=0, index=0)
    text = tokenizer.decode(sample.ids)
    coded = text.split("coded words. ", 1)[1].split("\nQuestion:")[0].split()
    counts = collections.Counter(coded)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == sample.answers
    assert counts[ranked[3]] > counts[ranked[4]]


def test_too_short_a_length_is_refused_with_the_need(src):
    with pytest.raises(ValueError, match=r"niah_multiquery needs about \d+ tokens or more with this tokenizer, got 200"
                       ) as info:
        check_length("niah_multiquery", src, 200)
    need = int(re.search(r"needs about (\d+)", str(info.value)).group(1))
    assert need > 200  # the length it names is one the task fits (give or take a sample's keys)
    check_length("niah_multiquery", src, need + 32)


def _shortest_checked(src, name: str) -> int:
    length = 64
    while True:
        try:
            check_length(name, src, length)
            return length
        except ValueError:
            length += 8


@pytest.mark.parametrize("name", list(TASKS))
def test_every_sample_fits_the_shortest_length_the_check_accepts(src, name):
    """Samples differ in their keys and words: the check leaves room for all of them (30 tried), or a run would
    fail on a later sample at a length it accepted."""
    length = _shortest_checked(src, name)
    for index in range(30):
        sample = generate(TASKS[name], src, length, seed=0, index=index, depth=index % 5 / 4)
        assert len(sample.ids) + sample.max_new_tokens == length


def test_cwe_says_when_its_word_pool_runs_out(src):
    with pytest.raises(ValueError, match=r"cwe fits at most about \d+ tokens: its word pool"):
        generate(TASKS["cwe"], src, 262144, seed=0)


def test_cwe_answer_budget_holds_the_numbered_list(src, tokenizer):
    sample = generate(TASKS["cwe"], src, 4096, seed=0)
    numbered = " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(sample.answers))
    assert len(tokenizer(numbered, add_special_tokens=False)["input_ids"]) < sample.max_new_tokens


def test_unpunctuated_text_still_offers_boundaries_near_each_depth(tokenizer):
    words = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * 3000).strip()
    plain = sources(Encoder(tokenizer, chat_template=False), [words])
    for depth in (0.1, 0.5, 0.9):
        sample = generate(TASKS["niah_single_2"], plain, 2048, seed=0, depth=depth)
        assert abs(sample.depth - depth) < 0.05


@pytest.mark.parametrize("text", [
    "\u6211\u4eec\u4eca\u5929\u53bb\u516c\u56ed\u6563\u6b65\u5929\u6c14\u5f88\u597d\u3002" * 3000,  # Chinese, full stops
    "\u6211\u4eec\u4eca\u5929\u53bb\u516c\u56ed\u6563\u6b65\u5929\u6c14\u5f88\u597d" * 3000,  # no punctuation, no space
], ids=["full stops", "unpunctuated"])
def test_text_without_spaces_still_offers_boundaries_near_each_depth(tokenizer, text):
    unspaced = sources(Encoder(tokenizer, chat_template=False), [text])
    for depth in (0.25, 0.5, 0.75):
        sample = generate(TASKS["niah_single_2"], unspaced, 512, seed=0, depth=depth)
        assert abs(sample.depth - depth) < 0.1  # not the whole haystack as one unit (depth 0 or 1 only)


def test_chat_template_wraps_the_task_and_prefills_the_answer_prefix(tokenizer, text):
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHATML
    enc = Encoder(chat)
    assert enc.chat
    sample = generate(TASKS["niah_single_1"], sources(enc, [text]), 1024, seed=0)
    decoded = chat.decode(sample.ids)
    assert len(sample.ids) + sample.max_new_tokens == 1024
    assert decoded.startswith("<|im_start|>user\nA special magic number")
    assert decoded.endswith("text?<|im_end|>\n<|im_start|>assistant\n The special magic number for "
                            + decoded.split("special magic number for ")[-1])
    plain = generate(TASKS["niah_single_1"], sources(Encoder(chat, chat_template=False), [text]), 1024, seed=0)
    assert "<|im_start|>" not in chat.decode(plain.ids)


def test_a_chat_template_that_raises_is_one_clear_error(tokenizer):
    """Templates that demand a system message raise from jinja (raise_exception): a ValueError that names the way
    out, not a jinja2 traceback; --no-chat-template then works."""
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% if messages[0]['role'] != 'system' %}{{ raise_exception('System role required') }}"
                            "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ValueError, match=r"chat template fails on a single user message .*System role required.*"
                                         r"use --no-chat-template"):
        Encoder(strict)
    assert not Encoder(strict, chat_template=False).chat


def test_insert_at_depths_keeps_every_token_and_the_order():
    ids = list(range(100))
    out, depths = insert_at_depths(ids, [0, 10, 20, 50, 90, 100], [(0.5, [-1]), (0.0, [-2]), (1.0, [-3])])
    assert [x for x in out if x >= 0] == ids
    assert out.index(-2) == 0 and out[-1] == -3 and out[out.index(-1) + 1] == 50
    assert depths == [0.5, 0.0, 1.0]
    hay = Haystack([[1, 2, 3], [4, 5]], "t")
    assert hay.take(1, 6) == ([4, 5, 1, 2, 3, 4], [0, 2, 5, 6])


# -- the pipeline, on an oracle that reads the prompt --------------------------------------------------------------

class Oracle(torch.nn.Module):
    """Answers a NIAH question by reading the needles in the decoded prompt: right exactly when the prompt holds
    the needle for the queried key."""

    def __init__(self, tokenizer):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer

    def generate(self, ids, attention_mask=None, max_new_tokens=1, **kwargs):
        text = self.tokenizer.decode(ids[0])
        facts = dict(_facts(text))
        query = re.search(r"for ([\w-]+) mentioned in the provided text\?", text).group(1)
        new = self.tokenizer(" " + facts.get(query, "I do not know"), add_special_tokens=False)["input_ids"]
        return torch.cat([ids, torch.tensor([new[:max_new_tokens]])], dim=1)


@pytest.mark.parametrize("name", ["niah_single_2", "niah_multikey_2", "niah_multikey_3"])
def test_oracle_scores_full_marks_and_nothing_once_the_needle_is_left_out(src, tokenizer, monkeypatch, name):
    model = Oracle(tokenizer)
    row = task_accuracy(model, src, name, 1024, samples=6, depths=(0.0, 0.5, 1.0), progress=False)
    assert row["accuracy"] == 1.0 and row["trials"] == 6
    assert row["depths"] == {"0": 1.0, "0.5": 1.0, "1": 1.0}
    assert row["prompt_tokens"] < 1024 and row["metric"] == "string_match_all"
    assert [p["score"] for p in row["predictions"]] == [1.0] * 6
    assert all(p["expected"][0] in p["output"] for p in row["predictions"])
    monkeypatch.setattr(ruler, "insert_at_depths", lambda ids, starts, pieces: (ids, [0.0] * len(pieces)))
    row = task_accuracy(model, src, name, 1024, samples=6, depths=(0.0, 0.5, 1.0), progress=False)
    assert row["accuracy"] == 0.0


@pytest.mark.parametrize("kwargs, said", [({"samples": 0}, "samples must be at least 1"),
                                          ({"depths": ()}, "between 0 and 1"),
                                          ({"depths": (0.5, 1.5)}, "between 0 and 1")])
def test_task_accuracy_refuses_bad_samples_and_depths(src, kwargs, said):
    with pytest.raises(ValueError, match=said):
        task_accuracy(None, src, "niah_single_1", 1024, progress=False, **kwargs)  # before any model call
