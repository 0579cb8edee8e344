"""Training data: documents read from files, folders, JSONL or a ``datasets`` name, tokenized, and packed
into sequences of the target length. Deterministic: the same recipe gives the same sequences in the same
order on every process, and a sample's index in the run alone says which sequence (and PoSE positions) it is
(so a resumed or multi-process run sees exactly the batches of an uninterrupted single-process run)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path

import torch

from ..data import textfiles
from .config import DataConfig, RecipeError, expand_files
from .rules import listed


def read_documents(path: Path, text_field: str, key: str) -> Iterator[str]:
    """One file's documents through the reader evaluation uses (undecodable bytes replaced, not fatal). A bad line
    is reported under ``key``, a damaged file under ``data``."""
    try:
        yield from textfiles.read_documents(path, text_field, hint="set data.text_field", errors="replace")
    except ValueError as exc:
        lines = textfiles.inner_suffix(path) in textfiles.JSONL_SUFFIXES | {".json"}
        raise RecipeError(f"{key if lines else 'data'}: {exc}") from None


def iter_documents(paths: list[Path], cfg: DataConfig) -> Iterator[str]:
    """Documents in a fixed order (at most ``max_documents``): a text file, a JSONL line or a dataset row each."""
    def every():
        for f in expand_files(paths, cfg.exclude):
            yield from read_documents(f, cfg.text_field, "data.files")
        if cfg.dataset:
            yield from _dataset_documents(cfg)

    yield from itertools.islice(every(), cfg.max_documents)


def _dataset_documents(cfg: DataConfig) -> Iterator[str]:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - declared extra
        raise RecipeError("data.dataset needs the datasets package: pip install 'ctxext[finetune]'") from exc
    try:
        ds = datasets.load_dataset(cfg.dataset, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming)
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds
        raise RecipeError(f"data.dataset {cfg.dataset!r}: cannot load ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    columns = getattr(ds, "column_names", None)
    if columns is not None and cfg.text_field not in columns:
        raise RecipeError(f"data.dataset {cfg.dataset!r} has no column {cfg.text_field!r} "
                          f"(columns: {', '.join(columns)}; set data.text_field)")
    for row in ds:
        if cfg.text_field not in row:
            raise RecipeError(f"data.dataset {cfg.dataset!r} rows have no {cfg.text_field!r} field "
                              f"(fields: {', '.join(row)}; set data.text_field)")
        yield str(row[cfg.text_field])


def tokenize_documents(tokenizer, docs: Iterator[str], add_eos: bool) -> torch.Tensor:
    """All documents as one token stream (each followed by EOS when ``add_eos`` and the tokenizer has one)."""
    eos = tokenizer.eos_token_id if add_eos else None
    pieces: list[torch.Tensor] = []
    for doc in docs:
        if not doc:
            continue
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        if eos is not None:
            ids = list(ids) + [eos]
        pieces.append(torch.tensor(ids, dtype=torch.long))
    if not pieces:
        raise RecipeError("data: the documents are empty")
    return torch.cat(pieces)


def pose_position_ids(length: int, target: int, chunks: int, seed: int, index: int) -> torch.Tensor:
    """PoSE position ids (Zhu et al. 2023) for sample ``index`` of a run: ``length`` positions spanning up to
    ``target``, a pure function of (``seed``, ``index``), so every process and a resumed run compute the same.

    The window is cut into ``chunks`` pieces; piece ``i`` keeps consecutive positions, shifted by a skip ``u_i``
    with ``u_0 = 0`` (the first piece starts at position 0) and ``u_i`` uniform in ``[u_{i-1}, target - length]``,
    so the last position is at most ``target - 1``. Two pieces (the paper's setting) follow the authors' code: the
    first holds 1 .. ceil(length / 2) tokens, the second the rest, shifted by a skip uniform in
    ``[0, target - length]``. More pieces: cut points uniform over ``1 .. length - 1``, all distinct.

    Drawn with ``random.Random(...).random()`` only, whose sequence Python keeps fixed across versions."""
    if not 2 <= chunks <= length:
        raise ValueError(f"PoSE needs 2 <= chunks <= length, got chunks={chunks}, length={length}")
    if target < length:
        raise ValueError(f"PoSE target length {target} is shorter than the window {length}")
    rng = random.Random(f"ctxext-pose:{seed}:{index}")

    def uniform(lo: int, hi: int) -> int:  # an integer in [lo, hi], both included
        return lo + min(int(rng.random() * (hi - lo + 1)), hi - lo)

    if chunks == 2:
        cuts = [uniform(1, (length + 1) // 2)]
    else:
        chosen: set[int] = set()
        while len(chosen) < chunks - 1:
            chosen.add(uniform(1, length - 1))
        cuts = sorted(chosen)
    bounds = [0, *cuts, length]
    skips = [0]
    for _ in range(chunks - 1):
        skips.append(uniform(skips[-1], target - length))
    positions = torch.arange(length, dtype=torch.long)
    for i in range(chunks):
        positions[bounds[i]:bounds[i + 1]] += skips[i]
    return positions


class PackedData:
    """Token stream cut into ``n`` sequences of ``seq_length``; sample ``i`` of the global stream is
    sequence ``order(epoch)[i % n]`` with ``epoch = i // n``, each epoch a fresh seeded permutation.

    With ``pose`` (``(target_length, chunks)``), sample ``i`` also has PoSE position ids,
    :func:`pose_position_ids` of the seed and ``i``; without it, the model's own (0 .. seq_length - 1)."""

    def __init__(self, sequences: torch.Tensor, seed: int, pose: tuple[int, int] | None = None):
        self.sequences = sequences
        self.seed = seed
        self.pose = pose
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.sequences.shape[0]

    @property
    def seq_length(self) -> int:
        return self.sequences.shape[1]

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders[epoch] = torch.randperm(len(self), generator=g)
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
        return self._orders[epoch]

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples ``start .. start+count-1`` as a (count, seq_length) tensor."""
        n = len(self)
        rows = [self.sequences[self.order(i // n)[i % n]] for i in range(start, start + count)]
        return torch.stack(rows)

    def positions(self, start: int, count: int) -> torch.Tensor | None:
        """PoSE position ids of global samples ``start .. start+count-1`` as (count, seq_length); None without PoSE."""
        if self.pose is None:
            return None
        target, chunks = self.pose
        return torch.stack([pose_position_ids(self.seq_length, target, chunks, self.seed, i)
                            for i in range(start, start + count)])

    def example(self, index: int) -> dict[str, torch.Tensor]:
        """Global sample ``index`` as a Trainer example: tokens as inputs and labels; with PoSE, its position ids
        and an all-ones attention mask. The mask is needed: given position ids that jump and no mask, transformers
        (5.x ``masking_utils``, ``find_packed_sequence_indices``) reads the jumps as boundaries of packed documents
        and masks every chunk off from the ones before it, so the long distances PoSE is for would never train."""
        ids = self.samples(index, 1)[0]
        example = {"input_ids": ids, "labels": ids}
        positions = self.positions(index, 1)
        if positions is not None:
            example.update(position_ids=positions[0], attention_mask=torch.ones_like(ids))
        return example


class RunSamples(torch.utils.data.Dataset):
    """The run's samples in order: item ``i`` is global sample ``i`` of :class:`PackedData` (``steps x batch_size``
    of them). Read in order (``SequentialSampler``), optimizer step ``k`` trains on samples ``k*batch ..
    (k+1)*batch - 1`` whatever the number of processes (accelerate hands process ``r`` every world-th micro-batch),
    and a resumed Trainer skips to exactly where the interrupted run stopped."""

    def __init__(self, data: PackedData, count: int):
        self.data, self.count = data, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.data.example(index)


def build_packed_data(recipe, tokenizer, seq_length: int, pose_target: int | None = None) -> PackedData:
    cfg = recipe.data
    paths = recipe.data_paths(cfg.files, "data.files")
    stream = tokenize_documents(tokenizer, iter_documents(paths, cfg), cfg.add_eos)
    n = stream.numel() // seq_length
    if n < 1:
        raise RecipeError(
            f"data: {stream.numel()} tokens, fewer than one sequence of data.seq_length={seq_length}; "
            "add data or shorten the sequences"
        )
    sequences = stream[: n * seq_length].view(n, seq_length)
    if cfg.max_sequences is not None and cfg.max_sequences < n:
        g = torch.Generator().manual_seed(recipe.train.seed)
        keep = torch.randperm(n, generator=g)[: cfg.max_sequences].sort().values
        sequences = sequences[keep]
    pose = (pose_target, recipe.train.pose.chunks) if pose_target else None
    return PackedData(sequences.contiguous(), recipe.train.seed, pose)


def read_eval_tokens(recipe, tokenizer) -> tuple[torch.Tensor, str]:
    """The evaluation text as one token stream, and a label for it."""
    texts, labels = [], []
    for item in listed(recipe.eval.data):
        if item in ("reference", "reference:emma"):
            from ..reference import reference_text

            texts.append(reference_text())
            labels.append("reference (held-out emma)")
        else:
            for p in expand_files(recipe.data_paths([item], "eval.data"), []):
                texts.extend(read_documents(p, recipe.data.text_field, "eval.data"))
            labels.append(item)
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long), ", ".join(labels)
