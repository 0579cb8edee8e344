"""The default offline run: the shipped reference models on the held-out book at 1x..8x their training length."""

from __future__ import annotations

from typing import Any

from .data import Texts
from ..loading import model_skeleton
from .runner import PASSKEY_ASKED, PASSKEY_NOT, PASSKEY_WHERE_IT_FITS, ModelJob

#: Tokens fed per (model, method, length) in the default run (64 windows at 1x ... 8 at 8x): the same
#: compute and the same number of scored tokens at every length, about 1.5 minutes in all on 2 idle CPU cores.
#: Fewer (4096: 2 windows at 8x) left differences of 20-40% between neighbouring lengths to chance.
DEMO_MAX_TOKENS = 16384


def _reference():
    try:
        from .. import reference
    except ImportError as exc:
        raise OSError(f"the reference models are not part of this installation ({exc})") from None
    return reference


def reference_texts() -> Texts:
    ref = _reference()
    return Texts([ref.reference_text()], {"data": "ctxext reference held-out book (Jane Austen, Emma)", "format": "bundled", "documents": 1})


def demo_jobs(texts: Texts | None = None, *, factor: float | None = None, dtype: str | None = None,
              device: str = "cpu", passkey_where_trained: bool = False) -> list[ModelJob]:
    """One job per reference model (LLaMA / GPT-2 / BLOOM families); without ``factor``, each at the factor of
    the longest length it runs (8 at the default lengths, 1x to 8x its trained length), as ``ctxext eval``. With ``passkey_where_trained`` (the demo's default passkey), passkey runs only on
    the references trained to retrieve, at the lengths its prompt fits: the others score 0% even at their trained
    length, and would cost the default run about a minute to show it."""
    ref = _reference()
    texts = texts or reference_texts()

    def loader(name: str):
        def load(state=None):
            from .device import resolve_dtype

            model = ref.reference_model(name)
            dt = resolve_dtype(dtype)
            if dt != "auto":
                model = model.to(dt)
            return model.to("cuda" if device in ("cuda", "auto") else "cpu").eval()

        return load

    jobs = []
    for name in ref.REFERENCE_NAMES:
        trained = ref.train_length(name)
        info: dict[str, Any] = {"model": f"ctxext.reference:{name}", "original_length": trained,
                                "title": f"reference {name} (trained at {trained})"}
        jobs.append(ModelJob(
            label=name, load_tokenizer=lambda name=name: ref.reference_tokenizer(name), load_model=loader(name),
            load_skeleton=lambda name=name: model_skeleton(str(ref.reference_path(name))),
            texts=texts, factor=factor, info=info,  # None: the longest length run / the trained length, as eval
            passkey=PASSKEY_ASKED if not passkey_where_trained else
            PASSKEY_WHERE_IT_FITS if name in ref.RETRIEVAL_NAMES else PASSKEY_NOT,
        ))
    return jobs
