"""Shared checks for the adapter tests: cached decoding, padded batches, causality, save and reload."""

from __future__ import annotations

import torch

import ctxext

VOCAB = 128


def no_eos(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def generate_equals_full_forward(model, prompt_len: int, new: int, seed: int = 4) -> torch.Tensor:
    """Greedy generate with the KV cache gives the tokens and per-step logits (atol 1e-4) of a full forward pass."""
    no_eos(model)
    prompt = torch.randint(2, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    sequence = out.sequences
    assert sequence.shape[1] == prompt_len + new
    full = model(sequence).logits[0, prompt_len - 1 : -1]  # the logits that predicted each new token
    torch.testing.assert_close(torch.cat(out.logits), full, atol=1e-4, rtol=0)
    assert torch.equal(full.argmax(-1), sequence[0, prompt_len:])
    return sequence


def padded_batch_equals_single_rows(model, lengths=(70, 45), position_ids: bool = True, seed: int = 7) -> None:
    """Left-padded rows of a batch give the logits of the same rows run alone (atol 1e-5)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(2, VOCAB, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    kwargs = {"attention_mask": mask}
    if position_ids:
        kwargs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    batch = model(ids, **kwargs).logits
    assert torch.isfinite(batch).all()
    for i, r in enumerate(rows):
        single = model(r[None]).logits[0]
        torch.testing.assert_close(batch[i, width - len(r) :], single, atol=1e-5, rtol=0)


def causal(model, length: int = 60, cut: int = 25, seed: int = 9) -> None:
    """Changing tokens from ``cut`` on leaves the logits before ``cut`` unchanged."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(2, VOCAB, (1, length), generator=gen)
    b = a.clone()
    b[0, cut:] = torch.randint(2, VOCAB, (length - cut,), generator=gen)
    la, lb = model(a).logits, model(b).logits
    torch.testing.assert_close(la[0, :cut], lb[0, :cut], atol=1e-6, rtol=0)
    assert not torch.allclose(la[0, cut:], lb[0, cut:])


def patch_survives_save_and_reload(model, tmp_path, method, factor, ids, unpatched_ids=None):
    """Patch, save, reload with ``ctxext.from_pretrained``: the same spec and bit-identical logits on ``ids``; after
    unpatch, the unpatched model's logits on ``unpatched_ids`` (default ``ids``) bit for bit. Plain
    ``AutoModelForCausalLM.from_pretrained`` loads the folder as the patched model (atol 1e-5) where the patch has a
    transformers-native form (``ctxext.export``), and otherwise refuses it, naming ``ctxext.from_pretrained``.
    Returns the reload."""
    import pytest
    from transformers import AutoModelForCausalLM

    from ctxext.export import check_native

    unpatched_ids = ids if unpatched_ids is None else unpatched_ids
    unpatched = model(unpatched_ids).logits
    ctxext.patch(model, method, factor)
    patched = model(ids).logits
    model.save_pretrained(tmp_path)
    if check_native(model) is None:
        plain = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        torch.testing.assert_close(plain(ids).logits, patched, atol=1e-5, rtol=0)
    else:
        with pytest.raises(ValueError, match=r"ctxext\.from_pretrained\(path\)"):
            AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = ctxext.from_pretrained(tmp_path)
    assert ctxext.describe(loaded) == ctxext.describe(model)
    assert torch.equal(loaded(ids).logits, patched)
    ctxext.unpatch(loaded)
    assert torch.equal(loaded(unpatched_ids).logits, unpatched)
    return loaded


def pi_table_reference(rows: torch.Tensor, factor: int) -> torch.Tensor:
    """PI's definition for a learned table, written out: row j = the table at position j / factor, linearly
    interpolated (the last rows, past position n - 1, hold row n - 1). In float64."""
    rows = rows.double()
    n = rows.shape[0]
    out = []
    for j in range(n * factor):
        p = min(j / factor, n - 1)
        lo = int(p)
        hi = min(lo + 1, n - 1)
        out.append(rows[lo] * (1 - (p - lo)) + rows[hi] * (p - lo))
    return torch.stack(out)
