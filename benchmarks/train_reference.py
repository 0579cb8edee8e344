#!/usr/bin/env python
"""Train the three reference checkpoints that ship in ``ctxext/assets/reference/``.

    python benchmarks/train_reference.py [--out DIR] [--seed 0] [--steps N]

One byte-level BPE tokenizer (``tokenizers``, 4096 entries) is trained on five Jane Austen novels
(``emma.txt`` is held out), then three causal LMs of the same size are pretrained from scratch on
the same token stream at a context of 256 tokens, one per positional family:

* ``llama``: LlamaForCausalLM, rotary positions (rope_theta 10000), grouped-query attention;
* ``gpt2``:  GPT2LMHeadModel, learned absolute positions (``wpe`` has 256 rows);
* ``bloom``: BloomForCausalLM, ALiBi (eager attention).

Everything runs on CPU. By default the three models train at once, one process each on one thread
(``--jobs 3 --threads 1``: about 4-5 CPU minutes per model, 7-8 minutes on an idle 2-core machine). Results are
deterministic given ``--seed`` and ``--threads`` (1 and 2 threads differ in low-order bits) on the same torch
build, whatever ``--jobs`` is. One thread per process is also the fast choice on a shared machine, where
OpenMP threads spin-wait on each other whenever one is descheduled.

Each model is saved with ``save_pretrained`` as safetensors in float16 if that costs at most
``--max-dtype-loss`` of held-out perplexity, else bfloat16, else float32 (or ``--dtype``), with the tokenizer
beside it, then reloaded as users will and checked. ``training.json`` records the configuration, steps,
loss curve (with held-out perplexity probes), wall and CPU time, machine, date and held-out perplexity; a run
over a subset of ``--models`` keeps the other models' records. The held-out book is shipped as ``emma.txt.xz``.

The shipped GPT-2 and BLOOM come from the default command (byte-identical on re-run); the shipped LLaMA
from ``--models llama --threads 2 --dtype bfloat16``. Write trial runs elsewhere with ``--out``: the default
replaces the shipped checkpoints.

``--repeat-fraction`` / ``--passkey-fraction`` (off by default) mix long-range structure into the training windows:
an earlier span repeated later, a pass key sentence and its question (issue 13; see ``make_structure``).
``--random-span-fraction`` (off by default) starts that fraction of windows with a span of random tokens repeated
later in the window (the calibration note's "Run B"). ``--copy-fraction`` (off by default) replaces that fraction
of each batch's rows with the copy sequences of ``ctxext lab`` (``[SEP, x, SEP, x]`` of random tokens, loss only on
the second copy; see ``make_copy_rows``), and ``--seq-len`` changes the training length (default 256; the LLaMA's
``max_position_embeddings`` follows it).

``--eval-only`` skips training and measures the checkpoints in ``--out`` at 1x, 2x, 4x and 8x the
training length (LLaMA also with ``--eval-methods``, default pi / ntk / yarn), the numbers in
``benchmarks/reference_training.md``; ``--recall`` adds a copy probe (a held-out passage repeated at the window's end),
``--copy-probe`` one in the format of the copy rows (random-token ``[SEP, x, SEP, x]`` filling each length).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import lzma
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "austen"
DEFAULT_OUT = ROOT / "ctxext" / "assets" / "reference"
HELD_OUT = "emma.txt"
EOS = "<|endoftext|>"
TRAIN_LENGTH = 256
NAMES = ("llama", "gpt2", "bloom")

# Model size shared by the three families: hidden 192, 4 layers, 6 heads of 32, tied embeddings
# (about 2.6M parameters; a 16-bit checkpoint is about 5 MB).
HIDDEN, LAYERS, HEADS, VOCAB = 192, 4, 6, 4096


# --------------------------------------------------------------------------------------------- data


def read_books(data: Path) -> tuple[dict[str, str], str]:
    books = sorted(p for p in data.glob("*.txt") if p.name != HELD_OUT)
    if len(books) != 5 or not (data / HELD_OUT).exists():
        raise SystemExit(f"expected five training books and {HELD_OUT} in {data}; found {[p.name for p in books]}")
    return {p.name: p.read_text(encoding="utf-8") for p in books}, (data / HELD_OUT).read_text(encoding="utf-8")


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 style: no unknown token, lossless round trip) with one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    """A transformers fast tokenizer around the trained one. Built from the ``Tokenizer`` object and
    saved as ``tokenizer.json``, so ``AutoTokenizer.from_pretrained(dir)`` loads it (building from
    vocab.json/merges.txt through the fast-class constructor can come out empty in transformers 5)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)


# -------------------------------------------------------------------------------------------- models


def build_model(name: str, tokenizer, length: int = TRAIN_LENGTH):
    import torch
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    eos = tokenizer.convert_tokens_to_ids(EOS)
    common = dict(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    if name == "llama":
        config = LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=3 * HIDDEN,  # SwiGLU: 3 matrices; with GQA the layer matches GPT-2's size
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS // 2,
            max_position_embeddings=length,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rms_norm_eps=1e-5,
            attn_implementation="sdpa",
            **common,
        )
        cls = LlamaForCausalLM
    elif name == "gpt2":
        config = GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_positions=length,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            attn_implementation="sdpa",
            **common,
        )
        cls = GPT2LMHeadModel
    elif name == "bloom":
        config = BloomConfig(
            hidden_size=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            max_position_embeddings=length,  # ALiBi reads no length: said for ctxext and lm-eval (else 2048)
            attn_implementation="eager",
            **common,
        )
        cls = BloomForCausalLM
    else:
        raise ValueError(f"unknown reference model {name!r}; choose from {', '.join(NAMES)}")
    return cls(config)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


# ---------------------------------------------------------------------------------------- evaluation


def perplexity(model, ids, length: int, max_tokens: int | None = None) -> float:
    """Perplexity over non-overlapping windows of ``length`` tokens (the first ``max_tokens`` tokens)."""
    import torch

    if max_tokens is not None:
        ids = ids[:max_tokens]
    n = (len(ids) // length) * length
    windows = ids[:n].view(-1, length)
    batch = max(1, 4096 // length)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            x = windows[i : i + batch]
            logits = model(input_ids=x).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
            )
            nll += loss.item()
            count += x[:, 1:].numel()
    return math.exp(nll / count)


def recall(model, ids, length: int, windows: int = 8, span: int = 64, source: int = 16) -> dict[str, float]:
    """Copy probe on the held-out book: in each of ``windows`` windows of ``length`` tokens (spread evenly over
    ``ids``), the ``span`` tokens at ``source`` are repeated as the window's last ``span`` tokens, so the copy sits
    ``length - span - source`` tokens after its original. Scored on the copy (all but its first token): top-1
    accuracy and perplexity. A model that reads far context copies it; one that cannot reach it sees plain text."""
    import torch

    step = max(length, (len(ids) - length) // max(1, windows - 1))
    starts = [i * step for i in range(windows) if i * step + length <= len(ids)]
    x = torch.stack([ids[s : s + length].clone() for s in starts])
    x[:, length - span :] = x[:, source : source + span]
    hits, nll, count = 0, 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(x), max(1, 4096 // length)):
            xb = x[i : i + max(1, 4096 // length)]
            logits = model(input_ids=xb).logits.float()[:, length - span : length - 1]
            target = xb[:, length - span + 1 :]
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1), reduction="sum").item()
            hits += (logits.argmax(-1) == target).sum().item()
            count += target.numel()
    return {"accuracy": round(hits / count, 4), "ppl": round(math.exp(nll / count), 3)}


def copy_probe(model, length: int, count: int = 32, seed: int = 1234) -> float:
    """Copy probe in the format of the lab's copy rows (``ctxext.lab.data.copy_batch``): ``count`` sequences
    ``[SEP, x, SEP, x]`` of total ``length`` with x random tokens from ``COPY_RANGE`` (the generator seeded with
    ``seed``); top-1 accuracy on the second copy, whose tokens sit ``(length - 2) // 2 + 1`` after their originals.
    Chance is 1/512; a model that does not read that far back scores near 0."""
    import torch

    from ctxext.lab.data import IGNORE, copy_batch

    gen = torch.Generator().manual_seed(seed)
    hits = total = 0
    per = max(1, 4096 // length)
    with torch.inference_mode():
        for i in range(0, count, per):
            x, tgt = copy_batch(min(per, count - i), length, gen)
            pred = model(input_ids=x).logits.argmax(-1)
            m = tgt != IGNORE
            hits += int((pred[m] == tgt[m]).sum())
            total += int(m.sum())
    return round(hits / total, 4)


def storage_roundtrip(model, dtype):
    """A float32 copy of ``model`` whose weights went through ``dtype`` (what loading a 16-bit checkpoint
    in float32 gives)."""
    import copy

    import torch

    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.copy_(p.to(dtype).to(torch.float32))
    return clone


# ------------------------------------------------------------------------------------------ training


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def probe(model, name, held_ids, length: int = TRAIN_LENGTH, copy_seed: int | None = None) -> dict[str, float]:
    """Held-out perplexity on the first 4096 tokens at 1x and (where positions allow) 4x the training length;
    with ``copy_seed`` also the lab-format copy accuracy at 1x (16 fixed copy sequences)."""
    was_training = model.training
    model.eval()
    out = {f"ppl_{length}": round(perplexity(model, held_ids, length, 4096), 2)}
    if name != "gpt2":  # GPT-2's wpe has one row per trained position
        out[f"ppl_{4 * length}"] = round(perplexity(model, held_ids, 4 * length, 4096), 2)
    if copy_seed is not None:
        out["copy_acc"] = copy_probe(model, length, count=16, seed=copy_seed)
    model.train(was_training)
    return out


def make_structure(tokenizer, args, length: int = TRAIN_LENGTH):
    """A function that rewrites a batch of training windows in place to contain long-range structure, or None.

    * ``--repeat-fraction p``: in each window with probability p, a span of ``--repeat-min``..``--repeat-max``
      tokens is copied from earlier in the window to a later place (overwriting the text there), at a distance
      drawn uniformly over what fits (from the span length up to nearly the whole window). Predicting the
      copy needs the far context: induction / copy heads.
    * ``--passkey-fraction q``: in each window with probability q, a sentence carrying a random 5-digit key
      (" The pass key is K. Remember it. K is the pass key.") is written at a random place and a question
      (" What is the pass key? The pass key is K.") later, in the Austen text.
    * ``--random-span-fraction r``: in each window with probability r, the window starts with a span of
      ``--random-span-min``..``--random-span-max`` random token ids (uniform over the vocabulary, end-of-text
      excluded) that is repeated at a random later place (overwriting the text there); the rest of the window
      stays Austen text (the calibration note's "Run B" data).
    Draws come from their own generator (seed + 2; the random spans from seed + 4), so the window order is the
    same as without them.
    """
    import torch

    if args.repeat_fraction <= 0 and args.passkey_fraction <= 0 and args.random_span_fraction <= 0:
        return None
    aux = torch.Generator().manual_seed(args.seed + 2)
    spans = torch.Generator().manual_seed(args.seed + 4)
    if args.random_span_fraction > 0 and not 1 <= args.random_span_min <= args.random_span_max <= length // 2:
        raise SystemExit(f"--random-span-min/--random-span-max must satisfy 1 <= min <= max <= {length // 2}")

    def encode(text):
        return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)

    def rand(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (1,), generator=aux))

    def apply(x):
        x = x.clone()
        for row in range(x.size(0)):
            if args.repeat_fraction > 0 and float(torch.rand((), generator=aux)) < args.repeat_fraction:
                s = rand(args.repeat_min, min(args.repeat_max, length // 2))
                a = rand(0, length - 2 * s)
                b = rand(a + s, length - s)
                x[row, b : b + s] = x[row, a : a + s].clone()
            if args.passkey_fraction > 0 and float(torch.rand((), generator=aux)) < args.passkey_fraction:
                key = rand(10000, 99999)
                needle = encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
                question = encode(f" What is the pass key? The pass key is {key}.")
                a = rand(0, length - len(needle) - len(question))
                b = rand(a + len(needle), length - len(question))
                x[row, a : a + len(needle)] = needle
                x[row, b : b + len(question)] = question
            if args.random_span_fraction > 0 and float(torch.rand((), generator=spans)) < args.random_span_fraction:
                s = int(torch.randint(args.random_span_min, args.random_span_max + 1, (1,), generator=spans))
                span = torch.randint(1, VOCAB, (s,), generator=spans)  # id 0 is the end-of-text token
                b = int(torch.randint(s, length - s + 1, (1,), generator=spans))
                x[row, :s] = span
                x[row, b : b + s] = span
        return x

    return apply


def make_copy_rows(args, length: int):
    """A function turning a batch of training windows into (ids, labels) with the last round(batch * p) rows
    replaced by copy sequences of the lab (``ctxext.lab.data.copy_batch``: ``[SEP, x, SEP, x]`` of total
    ``--copy-len`` tokens, x random tokens from ids 1000-1511, SEP the end-of-text token, id 0; padded with SEP
    to the window length), labelled -100 except on the second copy; text rows keep the plain LM labels. Returns
    None when ``--copy-fraction`` is 0. Copies are drawn from their own generator (seed + 3); the text windows
    are drawn as without copy rows (the first rows of each batch are the default run's windows)."""
    import torch

    if args.copy_fraction <= 0:
        return None
    from ctxext.lab.data import IGNORE, SEP, copy_batch

    n_copy = int(round(args.batch * args.copy_fraction))
    copy_len = args.copy_len or length
    if not 4 <= copy_len <= length:
        raise SystemExit(f"--copy-len must be between 4 and the training length {length}, got {copy_len}")
    if n_copy < 1:
        raise SystemExit(f"--copy-fraction {args.copy_fraction} gives no copy row in a batch of {args.batch}")
    if args.copy_min_len and not 4 <= args.copy_min_len <= copy_len:
        raise SystemExit(f"--copy-min-len must be between 4 and --copy-len {copy_len}, got {args.copy_min_len}")
    aux = torch.Generator().manual_seed(args.seed + 3)

    def apply(x):
        x = x.clone()
        labels = x.clone()
        first = x.size(0) - n_copy
        x[first:] = SEP
        labels[first:] = IGNORE
        if args.copy_min_len:  # one length per row, uniform in [--copy-min-len, --copy-len]
            sizes = torch.randint(args.copy_min_len, copy_len + 1, (n_copy,), generator=aux).tolist()
            parts = [copy_batch(1, n, aux) for n in sizes]
        else:
            sizes, parts = [copy_len] * n_copy, [copy_batch(n_copy, copy_len, aux)]
            parts = [(c[i : i + 1], t[i : i + 1]) for c, t in parts for i in range(n_copy)]
        for i, (n, (c, tgt)) in enumerate(zip(sizes, parts)):
            x[first + i, :n] = c[0]
            labels[first + i, 1:n] = tgt[0, : n - 1]  # tgt[p] is the token after p; HF labels are unshifted
        return x, labels

    return apply


def train_one(name, tokenizer, train_ids, held_ids, args):
    import torch

    torch.manual_seed(args.seed)
    span = args.seq_len
    model = build_model(name, tokenizer, span)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    # Same window order for every family: a generator seeded independently of the init.
    gen = torch.Generator().manual_seed(args.seed + 1)
    # Long-range structure mixed into the windows, copy rows in the batch (off by default: then no extra random
    # numbers are drawn, and the default run is byte-identical to the one without these options).
    structure = make_structure(tokenizer, args, span)
    copy_rows = make_copy_rows(args, span)
    copy_running = None
    starts_max = len(train_ids) - span
    log_every = args.log_every or max(1, args.steps // 10)
    t0, c0 = time.perf_counter(), time.process_time()
    probe_seconds = 0.0
    running = None
    curve = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = torch.randint(0, starts_max, (args.batch,), generator=gen)
        x = torch.stack([train_ids[s : s + span] for s in starts.tolist()])
        if structure is not None:
            x = structure(x)
        if copy_rows is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            x, labels = copy_rows(x)
            logits = model(input_ids=x).logits.float()
            per_token = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
            ).view(x.size(0), -1)
            mask = labels[:, 1:] != -100
            loss = per_token.sum() / mask.sum()
            n_copy = int(round(args.batch * args.copy_fraction))
            copy_loss = (per_token[-n_copy:].sum() / mask[-n_copy:].sum()).item()
            copy_running = copy_loss if copy_running is None else 0.95 * copy_running + 0.05 * copy_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t0 - probe_seconds
            cpu = time.process_time() - c0
            point = {"step": step + 1, "train_loss": round(running, 4), "seconds": round(elapsed, 1), "cpu_seconds": round(cpu, 1)}
            if copy_running is not None:
                point["copy_loss"] = round(copy_running, 4)
            if args.probe:
                tp = time.perf_counter()
                point.update(probe(model, name, held_ids, span, 4321 if copy_rows is not None else None))
                probe_seconds += time.perf_counter() - tp
            curve.append(point)
            extra = "".join(f"  {k} {v:.1f}" for k, v in point.items() if k.startswith("ppl"))
            extra += "".join(f"  {k} {point[k]:.3f}" for k in ("copy_loss", "copy_acc") if k in point)
            print(
                f"  [{name}] step {step + 1}/{args.steps}  loss {running:.3f}{extra}  "
                f"{elapsed:.0f}s wall  ({(step + 1) * args.batch * span / elapsed:.0f} tok/s)",
                flush=True,
            )
    seconds = {"wall": round(time.perf_counter() - t0 - probe_seconds, 1), "cpu": round(time.process_time() - c0, 1)}
    model.eval()
    return model, seconds, curve


def choose_dtype(model, held_ids, args) -> tuple[str, dict[str, float]]:
    import torch

    ppl = {"float32": perplexity(model, held_ids, args.seq_len, args.eval_tokens)}
    for label, dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16)):
        ppl[label] = perplexity(storage_roundtrip(model, dtype), held_ids, args.seq_len, args.eval_tokens)
    # float16 keeps 3 more mantissa bits than bfloat16 (and these small weights are far from its range
    # limits); take bfloat16 only if float16 costs more than the tolerance and bfloat16 does not.
    if args.dtype != "auto":
        return args.dtype, ppl
    for best in ("float16", "bfloat16"):
        if ppl[best] / ppl["float32"] - 1 <= args.max_dtype_loss:
            return best, ppl
    return "float32", ppl


def save_model(model, tokenizer, dtype: str, folder: Path) -> int:
    import torch

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    model.to(torch.float32)
    return sum(f.stat().st_size for f in folder.iterdir())


def check_saved(folder: Path, sample: str, ref_ppl: float, held_ids, args) -> float:
    """Reload from disk exactly as users will and confirm the tokenizer and perplexity."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(sample)["input_ids"]
    if len(tok) != VOCAB or tok.decode(ids) != sample:
        raise SystemExit(f"tokenizer in {folder} does not round-trip (vocab {len(tok)})")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ppl = perplexity(model, held_ids, args.seq_len, args.eval_tokens)
    if abs(ppl / ref_ppl - 1) > 1e-4:
        raise SystemExit(f"reloaded {folder.name} gives perplexity {ppl:.3f}, expected {ref_ppl:.3f}")
    return ppl


def machine() -> dict:
    info = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import tokenizers
    import torch
    import transformers

    info.update(torch=torch.__version__, transformers=transformers.__version__, tokenizers=tokenizers.__version__)
    info["torch_threads"] = torch.get_num_threads()
    return info


def train_and_save(name, args, tok_str, train_ids, held_ids, sample) -> tuple[str, dict]:
    """Train, pick the storage dtype, save and re-check one model; returns its record for training.json."""
    import torch
    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    tokenizer = wrap_tokenizer(Tokenizer.from_str(tok_str))
    t_model = time.perf_counter()
    print(f"{name}: training {args.steps} steps of {args.batch}x{args.seq_len} tokens on {args.threads} thread(s)", flush=True)
    model, seconds, curve = train_one(name, tokenizer, train_ids, held_ids, args)
    dtype, ppl = choose_dtype(model, held_ids, args)
    folder = args.out / name
    size = save_model(model, tokenizer, dtype, folder)
    reloaded = check_saved(folder, sample, ppl[dtype], held_ids, args)
    print(
        f"{name}: {n_params(model) / 1e6:.2f}M parameters, {seconds['wall']:.0f}s wall ({seconds['cpu']:.0f}s cpu); "
        f"held-out ppl@{args.seq_len} "
        + ", ".join(f"{k} {v:.2f}" for k, v in ppl.items())
        + f"; saved {dtype}, {size / 1e6:.1f} MB",
        flush=True,
    )
    return name, {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "class": type(model).__name__,
        "parameters": n_params(model),
        "config": json.loads(model.config.to_json_string()),
        "threads": args.threads,
        "train_seconds": seconds["wall"],
        "train_cpu_seconds": seconds["cpu"],
        "wall_seconds": round(time.perf_counter() - t_model, 1),
        "loss_curve": curve,
        f"held_out_ppl_{args.seq_len}": {k: round(v, 3) for k, v in ppl.items()},
        "saved_dtype": dtype,
        f"saved_ppl_{args.seq_len}": round(reloaded, 3),
        "folder_bytes": size,
    }


def train(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    books, held = read_books(args.data)
    print(f"training books: {', '.join(books)}; held out: {HELD_OUT}", flush=True)

    t0 = time.perf_counter()
    raw = train_tokenizer(list(books.values()), VOCAB)
    tokenizer = wrap_tokenizer(raw)
    tok_seconds = time.perf_counter() - t0
    eos = tokenizer.convert_tokens_to_ids(EOS)
    stream: list[int] = []
    for text in books.values():
        stream += raw.encode(text).ids + [eos]
    train_ids = torch.tensor(stream, dtype=torch.long)
    held_ids = torch.tensor(raw.encode(held).ids, dtype=torch.long)
    print(
        f"tokenizer: {len(tokenizer)} entries in {tok_seconds:.1f}s; {len(train_ids)} training tokens, "
        f"{len(held_ids)} held-out tokens",
        flush=True,
    )

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    sample = held[:2000]
    shared = {
        "seed": args.seed,
        "data": {
            "train_books": list(books),
            "held_out": HELD_OUT,
            "train_tokens": len(train_ids),
            "held_out_tokens": len(held_ids),
        },
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer), "special": [EOS]},
        "training": {
            "length": args.seq_len,
            "steps": args.steps,
            "batch": args.batch,
            "tokens_seen": args.steps * args.batch * args.seq_len,
            "optimizer": "AdamW(betas=(0.9, 0.95))",
            "lr": args.lr,
            "warmup": args.warmup,
            "schedule": "linear warmup, cosine decay to 0.1x",
            "weight_decay": args.weight_decay,
            "grad_clip": 1.0,
            "windows": f"uniformly random {args.seq_len}-token windows of the concatenated books (same order for every model)",
        },
        "eval": {
            "text": HELD_OUT,
            "tokens": min(len(held_ids), args.eval_tokens),
            "length": args.seq_len,
            "windows": "non-overlapping",
            "probes": f"ppl_{args.seq_len} / ppl_{4 * args.seq_len} in loss_curve: first 4096 held-out tokens"
            + ("; copy_acc: copy probe (lab format) at the training length, 16 sequences" if args.copy_fraction > 0 else ""),
        },
    }
    if args.repeat_fraction > 0 or args.passkey_fraction > 0:  # recorded only when used: default records unchanged
        shared["training"]["structure"] = {
            "repeat_fraction": args.repeat_fraction,
            "repeat_span": [args.repeat_min, args.repeat_max],
            "passkey_fraction": args.passkey_fraction,
            "generator_seed": args.seed + 2,
        }
    if args.random_span_fraction > 0:  # recorded only when used
        shared["training"]["random_spans"] = {
            "random_span_fraction": args.random_span_fraction,
            "span": [args.random_span_min, args.random_span_max],
            "format": "window starts with a span of random ids (uniform in 1..vocab-1) repeated at a uniform later "
            "place; rest Austen text; plain LM loss",
            "generator_seed": args.seed + 4,
        }
    if args.copy_fraction > 0:  # recorded only when used
        shared["training"]["copy_rows"] = {
            "copy_fraction": args.copy_fraction,
            "rows_per_batch": int(round(args.batch * args.copy_fraction)),
            "copy_len": args.copy_len or args.seq_len,
            **({"copy_min_len": args.copy_min_len} if args.copy_min_len else {}),
            "format": "ctxext.lab.data.copy_batch: [SEP, x, SEP, x], x uniform in ids 1000-1511, SEP = id 0; "
            "loss only on the second copy",
            "generator_seed": args.seed + 3,
        }
    report = {"date": None, "machine": machine(), **shared, "models": {}}
    # A run over a subset of the models keeps the others' records when they were trained the same way
    # (same tokenizer, data and settings), so the three can be trained in separate invocations.
    record = out / "training.json"
    if record.exists():
        old = json.loads(record.read_text())
        if all(old.get(k) == v for k, v in shared.items()):
            report["models"] = {k: v for k, v in old.get("models", {}).items() if k not in args.models}
    tokenizer_json = None
    for name in report["models"]:
        if (out / name / "tokenizer.json").exists():
            tokenizer_json = (out / name / "tokenizer.json").read_text()

    def write_record():
        report["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        report["models"] = {k: report["models"][k] for k in NAMES if k in report["models"]}
        record.write_text(json.dumps(report, indent=2) + "\n")

    command = "python benchmarks/train_reference.py " + " ".join(sys.argv[1:])
    tok_str = raw.to_str()
    jobs = max(1, min(args.jobs, len(args.models)))
    if jobs == 1:
        results = (train_and_save(name, args, tok_str, train_ids, held_ids, sample) for name in args.models)
    else:
        # One process per model, each on ``--threads`` threads: the result of a model does not depend
        # on how many are trained at once (each is deterministic given seed and thread count).
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
        futures = [pool.submit(train_and_save, n, args, tok_str, train_ids, held_ids, sample) for n in args.models]
        results = (f.result() for f in as_completed(futures))
    for name, entry in results:
        if tokenizer_json is not None and (out / name / "tokenizer.json").read_text() != tokenizer_json:
            raise SystemExit(f"the tokenizer trained now differs from the one saved beside the other models in {out}")
        report["models"][name] = {"command": command, **entry}
        write_record()  # as it goes
    if jobs > 1:
        pool.shutdown()

    with lzma.open(out / "emma.txt.xz", "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(held)
    write_record()
    print(f"done in {time.perf_counter() - t_start:.0f}s -> {out}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------ eval-only


def evaluate(args) -> int:
    """Held-out perplexity of the checkpoints in ``--out`` at 1x..8x the training length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import ctxext

    torch.set_num_threads(args.threads)
    text = lzma.open(args.out / "emma.txt.xz", "rt", encoding="utf-8").read()
    base = args.seq_len
    if base is None:  # the length the checkpoints were trained at
        record = args.out / "training.json"
        base = json.loads(record.read_text())["training"]["length"] if record.exists() else TRAIN_LENGTH
    lengths = [base * f for f in (1, 2, 4, 8)]
    rows = []
    for name in args.models:
        folder = args.out / name
        tok = AutoTokenizer.from_pretrained(folder)
        ids = torch.tensor(tok(text)["input_ids"])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        variants = [("none", None)]
        if name == "llama":
            variants += [(m, f) for f in (4, 8) for m in args.eval_methods.split(",")]
        for method, factor in variants:
            row = {"model": name, "method": method, "factor": factor}
            for length in lengths:
                if name == "gpt2" and length > base:
                    row[str(length)] = None  # wpe has 256 rows: needs the GPT-2 adapter
                    continue
                with ctxext.patched(model, method, factor) if method != "none" else contextlib.nullcontext():
                    if not args.recall_only:
                        row[str(length)] = round(perplexity(model, ids, length, args.eval_tokens), 3)
                    if args.recall and length >= 16 + 2 * 64:  # the passage and its copy must not overlap
                        row.setdefault("recall", {})[str(length)] = recall(model, ids, length)
                    if args.copy_probe:
                        row.setdefault("copy", {})[str(length)] = copy_probe(model, length, args.copy_probe_seqs)
            rows.append(row)
            label = method if factor is None else f"{method} x{factor}"
            if not args.recall_only:
                cells = "  ".join(f"{row[str(n)]:>8.2f}" if row.get(str(n)) is not None else f"{'n/a':>8}" for n in lengths)
                print(f"{name:6} {label:14} ppl     {cells}", flush=True)
            if args.recall:
                cells = "  ".join(
                    f"{row['recall'][str(n)]['accuracy']:>8.3f}" if str(n) in row.get("recall", {}) else f"{'n/a':>8}" for n in lengths
                )
                print(f"{name:6} {label:14} recall  {cells}", flush=True)
            if args.copy_probe:
                cells = "  ".join(f"{row['copy'][str(n)]:>8.3f}" if str(n) in row.get("copy", {}) else f"{'n/a':>8}" for n in lengths)
                print(f"{name:6} {label:14} copy    {cells}", flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "text": HELD_OUT,
        "tokens": args.eval_tokens,
        "lengths": lengths,
        "recall": "copy probe: 8 windows per length spread over the book; the 64 tokens at 16 repeated as the "
        "window's last 64; top-1 accuracy and perplexity on the copy (63 targets per window)"
        if args.recall
        else None,
        **(
            {
                "copy": f"lab-format copy probe: {args.copy_probe_seqs} sequences [SEP, x, SEP, x] of each length "
                "(ctxext.lab.data.copy_batch, generator seed 1234); top-1 accuracy on the second copy"
            }
            if args.copy_probe
            else {}
        ),
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the checkpoints go (default: the package assets)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the six Austen novels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps per model")
    p.add_argument("--batch", type=int, default=8, help="windows of 256 tokens per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per model (results depend on it)")
    p.add_argument("--jobs", type=int, default=3, help="models trained at once, one process each")
    p.add_argument("--models", default=",".join(NAMES), help="comma-separated subset of llama,gpt2,bloom")
    p.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens used for perplexity")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "float32"],
        help="storage dtype; auto: float16, else bfloat16, if it costs at most --max-dtype-loss",
    )
    p.add_argument("--max-dtype-loss", type=float, default=0.005, help="largest relative ppl loss a 16-bit save may cost")
    p.add_argument(
        "--repeat-fraction",
        type=float,
        default=0.0,
        help="fraction of training windows in which an earlier span is repeated later (induction / copy); default 0",
    )
    p.add_argument("--repeat-min", type=int, default=8, help="shortest repeated span, tokens")
    p.add_argument("--repeat-max", type=int, default=64, help="longest repeated span, tokens")
    p.add_argument(
        "--passkey-fraction",
        type=float,
        default=0.0,
        help="fraction of training windows given a 5-digit pass key sentence and, later, its question; default 0",
    )
    p.add_argument(
        "--random-span-fraction",
        type=float,
        default=0.0,
        help="fraction of training windows that start with a span of random tokens repeated later in the window "
        "(the rest Austen text); default 0",
    )
    p.add_argument("--random-span-min", type=int, default=16, help="shortest random span, tokens")
    p.add_argument("--random-span-max", type=int, default=48, help="longest random span, tokens")
    p.add_argument(
        "--copy-fraction",
        type=float,
        default=0.0,
        help="fraction of each batch's rows replaced by lab-format copy sequences [SEP, x, SEP, x] (loss only on "
        "the second copy); default 0",
    )
    p.add_argument("--copy-len", type=int, default=0, help="total length of a copy sequence (default: the training length)")
    p.add_argument(
        "--copy-min-len",
        type=int,
        default=0,
        help="if set, each copy row's total length is drawn uniformly from [this, --copy-len] (copy distances vary)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help=f"training length in tokens (default {TRAIN_LENGTH}; --eval-only: from training.json)"
    )
    p.add_argument("--log-every", type=int, default=0, help="log every N steps (default: steps/10)")
    p.add_argument("--no-probe", dest="probe", action="store_false", help="skip the perplexity probes while training")
    p.add_argument("--eval-only", action="store_true", help="measure the saved checkpoints at 256..2048 tokens")
    p.add_argument("--json", type=Path, help="with --eval-only: write the table as JSON here")
    p.add_argument(
        "--eval-methods", default="pi,ntk,yarn", help="with --eval-only: LLaMA methods at factors 4 and 8 (default pi,ntk,yarn)"
    )
    p.add_argument(
        "--recall",
        action="store_true",
        help="with --eval-only: also the copy probe (a 64-token held-out passage repeated at the window's end)",
    )
    p.add_argument(
        "--recall-only", action="store_true", help="with --eval-only: no perplexity; the recall probe (or only --copy-probe if given)"
    )
    p.add_argument(
        "--copy-probe",
        action="store_true",
        help="with --eval-only: also a copy probe in the format of the copy rows (random-token [SEP, x, SEP, x] of each length)",
    )
    p.add_argument("--copy-probe-seqs", type=int, default=32, help="sequences per length in --copy-probe")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.recall = args.recall or (args.recall_only and not args.copy_probe)
    if not args.eval_only and args.seq_len is None:
        args.seq_len = TRAIN_LENGTH
    if not 0 <= args.copy_fraction <= 1:
        p.error(f"--copy-fraction must be in [0, 1], got {args.copy_fraction}")
    unknown = set(args.models) - set(NAMES)
    if unknown:
        p.error(f"unknown model(s) {sorted(unknown)}; choose from {', '.join(NAMES)}")
    return evaluate(args) if args.eval_only else train(args)


if __name__ == "__main__":
    sys.exit(main())
