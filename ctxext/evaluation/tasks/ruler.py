"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your Long-Context Language
Models?"; task definitions, templates and scores from NVIDIA/RULER ``scripts/data/synthetic/`` and
``scripts/synthetic.yaml``), generated offline, token-exact, in the model's own tokenizer.

Where ctxext differs from RULER, and why:
- The essay haystack is local text (the bundled book, or ``--data``) split into sentences, not Paul Graham's essays
  (which RULER fetches from the network).
- The needle that answers the first query sits at the sample's stated depth (``--task-depths``), so accuracy can be
  drawn by depth x length; RULER draws every needle's depth at random. Other needles take depths drawn with
  replacement from RULER's grid (40 depths, 0-100%) in every haystack; RULER draws distinct grid depths in the essay
  haystack and uniform random lines in the noise and needle haystacks. Needles and chain lines go in at unit
  (sentence) boundaries.
- A prompt fills exactly ``length - max_new_tokens`` tokens: pieces are tokenized apart and the haystack is cut at
  the token (RULER fits whole words or units by search, so its prompts fall short by up to a unit).
- ``max_new_tokens`` is the expected answer's length in tokens plus 16, at most RULER's budget (128 for NIAH, 30 for
  VT, 120 for CWE, 50 for FWE): short windows keep their haystack and CPU runs stay short. Greedy decoding, as RULER.
- Zero-shot: RULER prepends a one-shot example to VT and CWE (lm-eval's CWE runs zero-shot too).
- Distractor keys never equal a queried key (RULER does not check).
- QA tasks (``qa_1``, ``qa_2``) need SQuAD / HotpotQA, which are not offline; they are not offered.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable

from . import words
from .tokens import Encoder, Haystack, insert_at_depths

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
#: RULER's needle depths, in percent.
DEPTH_GRID = [round(100 * i / 39) for i in range(40)]
#: Tokens generated beyond the expected answer's own.
ANSWER_MARGIN = 16

NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for "
                 "{query} mentioned in the provided text?")
NIAH_ANSWER = " The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class Task:
    """One synthetic task: its generator (RULER's task type), RULER's settings for it, and RULER's generation budget."""

    name: str
    generator: str  # niah | vt | cwe | fwe
    settings: tuple = ()
    ruler_tokens: int = 128
    metric: str = "all"
    doc: str = ""

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.settings)

    @property
    def has_depth(self) -> bool:
        """Whether a sample's needle depth is stated (and drawn in the needle heatmap)."""
        return self.generator == "niah"


def _niah(name: str, haystack: str, type_k: str, type_v: str, k: int = 1, v: int = 1, q: int = 1, doc: str = "") -> Task:
    return Task(name, "niah", (("haystack", haystack), ("type_k", type_k), ("type_v", type_v), ("k", k), ("v", v),
                               ("q", q)), 128, doc=doc)


TASKS: dict[str, Task] = {t.name: t for t in (
    _niah("niah_single_1", "noise", "words", "numbers", doc="one number in repeated noise sentences"),
    _niah("niah_single_2", "essay", "words", "numbers", doc="one number in prose"),
    _niah("niah_single_3", "essay", "words", "uuids", doc="one UUID in prose"),
    _niah("niah_multikey_1", "essay", "words", "numbers", k=4, doc="one number among 4 keys' needles, in prose"),
    _niah("niah_multikey_2", "needle", "words", "numbers", doc="one number in a haystack of distractor needles"),
    _niah("niah_multikey_3", "needle", "uuids", "uuids", doc="one UUID keyed by a UUID among distractor needles"),
    _niah("niah_multivalue", "essay", "words", "numbers", v=4, doc="all 4 numbers of one key, in prose"),
    _niah("niah_multiquery", "essay", "words", "numbers", q=4, doc="the numbers of 4 keys, in prose"),
    Task("vt", "vt", (("chains", 1), ("hops", 4)), 30, doc="variable tracking: the 5 names bound to a value"),
    Task("cwe", "cwe", (("freq_cw", 30), ("freq_ucw", 3), ("num_cw", 10)), 120,
         doc="common-word extraction: the 10 most common words of a list"),
    Task("fwe", "fwe", (("alpha", 2.0),), 50, doc="frequent-word extraction: the 3 most frequent coded words"),
)}


@dataclass
class Sample:
    ids: list[int]
    answers: list[str]
    max_new_tokens: int
    #: Depth of the needle that answers the first query (fraction of the haystack before it); None: not a needle task.
    depth: float | None = None


@dataclass
class Sources:
    """A tokenizer's haystacks for one run: prose sentences from the evaluation text, and RULER's noise sentence."""

    encoder: Encoder
    essay: Haystack
    noise: Haystack = field(init=False)

    def __post_init__(self):
        self.noise = Haystack([self.encoder.ids(NOISE + "\n")], "noise")


def sources(encoder: Encoder, texts: list[str]) -> Sources:
    return Sources(encoder, Haystack(encoder.many([" " + s for s in split_sentences(texts)]), "prose"))


#: Words at most in one haystack unit: a needle goes in between units, so text without sentence punctuation (code,
#: lower-case) still offers a boundary every few dozen words.
UNIT_WORDS = 40
#: A script written without spaces (Chinese, Japanese, Thai) makes a whole paragraph one "word": a run longer than
#: LONG_RUN characters (English words, dash-joined ones too, stay far below it) is cut every UNIT_CHARS characters
#: (10-20 tokens with a tokenizer that knows the script, about 50 with a byte-level one that does not).
UNIT_CHARS = 16
LONG_RUN = 64
#: Sentence ends of scripts that put no space after them (Chinese and Japanese full stops, ! and ?).
_UNSPACED_ENDS = re.compile(r"(?<=[\u3002\uff01\uff1f])")


def split_sentences(texts: list[str]) -> list[str]:
    """Sentences (after ., ! or ? and a space before a capital, digit or quote; after a full-width 。！？), long
    ones cut every UNIT_WORDS words, and runs without spaces every UNIT_CHARS characters."""
    out = []
    for text in texts:
        flat = " ".join(text.split())
        for spaced in re.split(r"(?<=[.!?])\s+(?=[\"'A-Z0-9(])", flat):
            for sentence in filter(None, (part.strip() for part in _UNSPACED_ENDS.split(spaced))):
                out.extend(_units(sentence))
    return out


def _units(sentence: str) -> list[str]:
    """A sentence as units of at most UNIT_WORDS words; a run without spaces longer than LONG_RUN becomes units of
    UNIT_CHARS characters."""
    units, words_ = [], []
    for word in sentence.split(" "):
        if len(word) > LONG_RUN:
            units += [" ".join(words_)] if words_ else []
            units += [word[i : i + UNIT_CHARS] for i in range(0, len(word), UNIT_CHARS)]
            words_ = []
            continue
        words_.append(word)
        if len(words_) == UNIT_WORDS:
            units.append(" ".join(words_))
            words_ = []
    return units + ([" ".join(words_)] if words_ else [])


def sample_rng(task: str, seed: int, length: int, index: int) -> random.Random:
    """The sample's own generator: the same sample for every method, process count and order of evaluation."""
    return random.Random(f"ctxext-ruler/{task}/{seed}/{length}/{index}")


def generate(task: Task, src: Sources, length: int, *, seed: int = 0, index: int = 0, depth: float = 0.5) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens (prompt + generation budget)."""
    rng = sample_rng(task.name, seed, length, index)
    return _GENERATORS[task.generator](task, src, length, rng, depth)


def _budget(task: Task, enc: Encoder, answers: list[str]) -> int:
    """Tokens to generate: the expected answer's, written the way the prompt invites (CWE: a numbered list), plus
    ANSWER_MARGIN, at most RULER's budget."""
    numbered = task.generator == "cwe"
    written = " ".join(f"{i + 1}. {a}" for i, a in enumerate(answers)) if numbered else ", ".join(answers)
    return min(task.ruler_tokens, len(enc.ids(" " + written)) + ANSWER_MARGIN)


class TooShort(ValueError):
    """A length below what a sample's fixed parts take; ``minimum`` is the shortest length that holds them."""

    def __init__(self, message: str, *, minimum: int):
        super().__init__(message)
        self.minimum = minimum


def _frame(task: Task, enc: Encoder, length: int, template: str, answer_prefix: str, answers: list[str],
           fixed: int = 0) -> tuple[list[int], list[int], int, int]:
    """(head ids, tail ids, max_new_tokens, context tokens left) for a template holding ``{context}``."""
    before, after = template.split("{context}")
    head, tail = enc.head(before), enc.tail(after, answer_prefix)
    new = _budget(task, enc, answers)
    need = length - new - len(head) - len(tail) - fixed
    if need < 1:
        raise TooShort(f"{task.name} needs more than {length} tokens ({length - need + 1} at least: the "
                       f"instructions, question and answer take {length - need} with this tokenizer)",
                       minimum=length - need + 1)
    return head, tail, new, need


def _unique(draw: Callable[[random.Random], str], rng: random.Random, n: int, avoid=()) -> list[str]:
    out: list[str] = []
    seen = set(avoid)
    while len(out) < n:
        x = draw(rng)
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


def _niah_sample(task: Task, src: Sources, length: int, rng: random.Random, depth: float) -> Sample:
    o = task.options
    enc = src.encoder
    draw_k, draw_v = words.DRAW[o["type_k"]], words.DRAW[o["type_v"]]
    keys = _unique(draw_k, rng, max(o["k"], o["q"]))
    values = [[draw_v(rng) for _ in range(o["v"])] for _ in keys]
    queries = rng.sample(range(len(keys)), o["q"])
    answers = [v for qi in queries for v in values[qi]]
    type_v = o["type_v"]
    template, prefix = NIAH_TEMPLATE, NIAH_ANSWER
    if o["q"] * o["v"] == 1:  # RULER's singular wording for one expected value
        joined = (template + "\x00" + prefix)
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            joined = joined.replace(a, b)
        template, prefix = joined.split("\x00")
        type_v_text = type_v[:-1]
    else:
        type_v_text = type_v
    names = [keys[qi] for qi in queries]
    query = names[0] if len(names) == 1 else ", ".join(names[:-1]) + ", and " + names[-1]
    fill = dict(type_v=type_v_text, query=query)
    template = template.replace("{context}", "\x01").format(**fill).replace("\x01", "{context}")
    prefix = prefix.format(**fill)
    sep = "\n" if o["haystack"] in ("noise", "needle") else ""
    lead = "" if sep else " "
    needles = [(ki, enc.ids(lead + NEEDLE.format(type_v=type_v, key=keys[ki], value=val) + sep))
               for ki in range(len(keys)) for val in values[ki]]
    rng.shuffle(needles)
    target = next(i for i, (ki, _) in enumerate(needles) if ki == queries[0])
    fixed = sum(len(ids) for _, ids in needles)
    head, tail, new, need = _frame(task, enc, length, template, prefix, answers, fixed)
    if o["haystack"] == "needle":
        hay = _distractors(task, enc, rng, need, avoid=keys)
        context, starts = hay.take(0, need)
    else:
        hay = src.noise if o["haystack"] == "noise" else src.essay
        context, starts = hay.take(rng.randrange(len(hay.units)), need)
    depths = [depth if i == target else rng.choice(DEPTH_GRID) / 100 for i in range(len(needles))]
    context, placed = insert_at_depths(context, starts, [(d, ids) for d, (_, ids) in zip(depths, needles)])
    return Sample(head + context + tail, answers, new, placed[target])


def _distractors(task: Task, enc: Encoder, rng: random.Random, need: int, avoid) -> Haystack:
    """RULER's needle haystack: needles of fresh keys and values of the task's types, enough for ``need`` tokens."""
    o = task.options
    draw_k, draw_v = words.DRAW[o["type_k"]], words.DRAW[o["type_v"]]
    units: list[list[int]] = []
    total = 0
    seen = set(avoid)
    while total < need:
        batch = []
        for _ in range(max(8, (need - total) // 16)):
            key = draw_k(rng)
            if key in seen:
                continue
            seen.add(key)
            batch.append(NEEDLE.format(type_v=o["type_v"], key=key, value=draw_v(rng)) + "\n")
        for ids in enc.many(batch):
            units.append(ids)
            total += len(ids)
    return Haystack(units, "needle")


def _vt_sample(task: Task, src: Sources, length: int, rng: random.Random, depth: float) -> Sample:
    o = task.options
    enc = src.encoder
    n = o["hops"] + 1
    names = _unique(lambda r: "".join(r.choices(string.ascii_uppercase, k=5)), rng, o["chains"] * n)
    chains, answers = [], []
    for c in range(o["chains"]):
        mine = names[c * n : (c + 1) * n]
        value = str(rng.randint(10000, 99999))
        lines = [f"VAR {mine[0]} = {value}\n"] + [f"VAR {mine[i]} = VAR {mine[i - 1]} \n" for i in range(1, n)]
        chains.append((value, lines))
        if c == 0:
            answers, query = mine, value
    fill = dict(query=query, num_v=n)
    template = VT_TEMPLATE.replace("{context}", "\x01").format(**fill).replace("\x01", "{context}")
    pieces = [enc.ids(line) for _, lines in chains for line in lines]
    head, tail, new, need = _frame(task, enc, length, template, VT_ANSWER.format(**fill), answers,
                                   sum(len(p) for p in pieces))
    context, starts = src.noise.take(0, need)
    spots = sorted(rng.random() for _ in pieces)  # in chain order, at random depths
    context, _ = insert_at_depths(context, starts, list(zip(spots, pieces)))
    return Sample(head + context + tail, answers, new)


def _fit(build: Callable[[int], list[int]], low: int, high: int, need: int, what: str) -> tuple[int, list[int]]:
    """The largest size in [low, high] whose ids fit ``need`` tokens, by bisection (sizes grow the ids)."""
    best = build(low)
    if len(best) > need:
        raise ValueError(what)
    size = low
    while low < high:
        mid = (low + high + 1) // 2
        ids = build(mid)
        if len(ids) <= need:
            low, best, size = mid, ids, mid
        else:
            high = mid - 1
    return size, best


def _cwe_sample(task: Task, src: Sources, length: int, rng: random.Random, depth: float) -> Sample:
    o = task.options
    enc = src.encoder
    freq_cw, freq_ucw = (o["freq_cw"], o["freq_ucw"]) if length >= 4096 else (6, 1)  # RULER's short-context counts
    num_cw = o["num_cw"]
    pool = list(words.common_pool())
    order = rng.sample(pool, len(pool))
    common = order[:num_cw]
    shuffle_seed = rng.random()

    def build(num_words: int) -> list[int]:
        chosen = common + order[num_cw:num_words]
        listed = chosen[:num_cw] * freq_cw + chosen[num_cw:] * freq_ucw
        random.Random(shuffle_seed).shuffle(listed)
        return enc.ids(" ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)))

    head, tail, new, need = _frame(task, enc, length, CWE_TEMPLATE, CWE_ANSWER, common)
    high = min(len(pool) - 64, num_cw + need)  # each word costs at least a token
    size, context = _fit(build, num_cw, high, need, f"cwe needs more than {length} tokens for {num_cw} words x "
                         f"{freq_cw} with this tokenizer")
    count = num_cw * freq_cw + (size - num_cw) * freq_ucw
    spare = " " + " ".join(f"{count + 1 + i}. {w}" for i, w in enumerate(order[size : size + 64]))
    context = context + enc.ids(spare)[: need - len(context)]  # words seen once: the top 10 stay the top 10
    if len(context) < need:
        raise ValueError(f"cwe fits at most about {len(context) + len(head) + len(tail) + new} tokens: its word "
                         f"pool ({len(pool)} words) runs out before {length}")
    return Sample(head + context + tail, common, new)


def _fwe_sample(task: Task, src: Sources, length: int, rng: random.Random, depth: float) -> Sample:
    alpha = task.options["alpha"]
    enc = src.encoder
    vocab_size = max(5, (length - task.ruler_tokens) // 50)
    vocab = sorted(set(_unique(lambda r: "".join(r.choices(string.ascii_lowercase, k=6)), rng, vocab_size)))
    rng.shuffle(vocab)
    vocab[0] = "..."  # the most frequent "word" is noise, as in RULER
    answers = vocab[1:4]
    zeta = sum(k ** -alpha for k in range(1, 100000)) + 1 / ((alpha - 1) * 100000 ** (alpha - 1))
    shuffle_seed = rng.random()

    def counts(num_words: int) -> list[int]:
        return [int(num_words * (k + 1) ** -alpha / zeta) for k in range(len(vocab))]

    def build(num_words: int) -> list[int]:
        listed = [w for w, c in zip(vocab, counts(num_words)) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(listed)
        return enc.ids(" ".join(listed))

    head, tail, new, need = _frame(task, enc, length, FWE_TEMPLATE, FWE_ANSWER, answers)
    size, context = _fit(build, 1, 2 * need + 100, need, f"fwe needs more than {length} tokens with this tokenizer")
    c = counts(size)
    if c[3] <= c[4]:  # the third answer must be strictly more frequent than the next word
        raise ValueError(f"fwe needs more than {length} tokens: the three most frequent words are not yet distinct")
    context = context + enc.ids(" ..." * need)[: need - len(context)]  # noise, already the most frequent
    return Sample(head + context + tail, answers, new)


_GENERATORS = {"niah": _niah_sample, "vt": _vt_sample, "cwe": _cwe_sample, "fwe": _fwe_sample}
