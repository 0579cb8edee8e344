"""A model object the caller holds (``ctxext.evaluate(model, tokenizer=...)``): evaluated in place, given back as it was.

Each method is applied to that object and removed again (``unpatch`` restores it bit-exactly); the object's
training flag is restored too. :func:`held_model_job` hands the runner a job whose ``release`` does this, and the
runner calls it also when a method fails or the user interrupts the run. A model that comes patched is evaluated
as it is: :func:`check_held_model` refuses other methods, and a key-token evaluator that would take its patch off.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..core.errors import PatchError
from .data import Texts
from .requests import MethodChoice, with_factor
from .runner import ModelJob


def _parameters(model):
    return list(model.parameters())


def held_device(model) -> str:
    """Where the object computes, as ``--device`` names it: ``cuda`` if any weight is on a GPU, else ``cpu``."""
    return "cuda" if any(p.device.type == "cuda" for p in _parameters(model)) else "cpu"


def held_dtype(model) -> str:
    params = _parameters(model)
    return str(params[0].dtype).replace("torch.", "") if params else "float32"


def _name(model) -> str:
    return str(getattr(model.config, "_name_or_path", "") or type(model).__name__)


def _label(model) -> str:
    name = _name(model)
    path = Path(name)
    return path.name if path.exists() else name


def weights_sample(model) -> str:
    """A sha256 over each weight's name, shape and first 64 values: what a resume compares for a model object (a
    folder's files are not there to compare; hashing every weight would cost more than most rows)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
        digest.update(param.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest()


def _tokenizer_digest(tokenizer) -> str:
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    chat = getattr(tokenizer, "chat_template", None)
    text = json.dumps([sorted(vocab.items()), chat, type(tokenizer).__name__], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_held_model(request, methods: MethodChoice) -> None:
    """A patched model object is evaluated as it is: other methods, or an evaluator that needs its patch off, are
    refused (taking the patch off and putting another on would not give the caller back the object as it was)."""
    from ..api import describe

    spec = describe(request.model)
    if spec is None:
        return
    label = f"{spec['method']}" + (f" x{spec['factor']:g}" if spec.get("factor") is not None else "")
    if methods.given is not None:
        asked = with_factor(list(methods.given), spec.get("factor"))
        if not all(q.matches(spec) for q in asked):
            raise PatchError(f"methods: the model is already patched ({label}) and is evaluated as it is; leave "
                             "methods out, or unpatch it first (ctxext.unpatch(model)) to compare methods")
    if request.key_tokens and not request.evaluator:
        raise ValueError(f"key_tokens: the default evaluator is the model itself without its patch, and this model "
                         f"is patched ({label}); give evaluator= (e.g. the base model's folder)")


def given_texts(texts: tuple[str, ...]) -> Texts:
    return Texts(list(texts), {"data": "texts given in Python", "format": "strings", "documents": len(texts)})


def held_model_job(model, tokenizer, texts: Texts, *, factor: float | None) -> ModelJob:
    """The runner's job for a model object: it loads nothing, and ``release`` gives the object back as it came
    (its patch, or none; its training flag)."""
    from ..api import describe, unpatch

    came_with = describe(model)
    was_training = bool(getattr(model, "training", False))

    def load(state) -> Any:
        return model.eval()

    def release(m) -> None:
        try:
            if came_with is None and describe(m) is not None:
                unpatch(m)
        finally:
            m.train(was_training)

    info = {"model": _name(model), "object": type(model).__name__, "weights_sample": weights_sample(model),
            "tokenizer_sample": _tokenizer_digest(tokenizer)}
    return ModelJob(label=_label(model), load_tokenizer=lambda: tokenizer, load_model=load,
                    load_skeleton=lambda: model, texts=texts, factor=factor, info=info, release=release)
