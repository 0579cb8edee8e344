"""A model object the caller holds (``ctxext.evaluate(model, tokenizer=...)``): evaluated in place, given back as it was.

Each method is applied to that object and removed again (``unpatch`` restores it bit-exactly); the object's
training flag is restored too. :func:`held_model_job` hands the runner a job whose ``release`` does this, and the
runner calls it also when a method fails or the user interrupts the run. A model that comes patched is evaluated
as it is: :func:`check_held_model` refuses other methods, and a key-token evaluator that would take its patch off.
One call at a time holds an object (:func:`held_alone`); a resume compares every value of its weights and buffers
(:func:`weights_digest`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Iterator

import torch

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


#: Bytes of a tensor hashed at a time (one piece copied off a GPU at a time).
_HASH_PIECE = 1 << 26

#: Rope types whose rotary module rewrites its ``inv_freq`` from the sequence length in every forward (transformers'
#: ``dynamic_rope_update``): that buffer is the last forward's state, not the model.
_LENGTH_FOLLOWING_ROPE = ("dynamic", "longrope")


def _state_of_last_forward(module, name: str) -> bool:
    """Whether buffer ``name`` of ``module`` holds rotary frequencies its forward sets from the sequence length
    (a dynamic or longrope rope type, or ctxext's dynamic-NTK hook): what it is computed from is hashed instead
    (``original_inv_freq``, the config, the patch)."""
    if not name.endswith("inv_freq") or name.endswith("original_inv_freq"):
        return False
    kinds = getattr(module, "rope_type", None)
    kinds = list(kinds.values()) if isinstance(kinds, dict) else [kinds]
    return "_ctxext_dynamic" in vars(module) or any(k in _LENGTH_FOLLOWING_ROPE for k in kinds if isinstance(k, str))


def _hash_values(digest, tensor) -> None:
    """Every value of ``tensor``, as its bytes (bfloat16 and float8 have no numpy type: their bit patterns)."""
    flat = tensor.detach().reshape(-1)
    if flat.is_meta:  # no values to read: a meta model is refused where its weights are first needed
        digest.update(b"meta")
        return
    try:
        raw = flat.contiguous().view(torch.uint8)
    except (RuntimeError, TypeError):  # a tensor subclass without a byte view: its values as float64
        raw = flat.double().contiguous().view(torch.uint8)
    for start in range(0, raw.numel(), _HASH_PIECE):
        digest.update(raw[start:start + _HASH_PIECE].cpu().numpy())


def weights_digest(model) -> str:
    """A sha256 over every value of every parameter and buffer (with its name, shape and dtype) and the ctxext
    patch: what a resume compares for a model object (a folder's files are not there to compare). About a second per
    2 GB of weights, small beside an evaluation. Buffers count (rotary frequencies a patch or a hand edit changed),
    except the frequencies a dynamic rope type resets in every forward (see ``_state_of_last_forward``); a patch the
    evaluation applies and removes leaves the digest as it was (``unpatch`` restores bit-exactly)."""
    from ..api import describe

    digest = hashlib.sha256(json.dumps(describe(model), sort_keys=True, default=str).encode())
    seen: set[int] = set()  # a tied weight once, under its first name
    for prefix, module in model.named_modules():
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            if id(tensor) in seen or _state_of_last_forward(module, name):
                continue
            seen.add(id(tensor))
            digest.update(f"{prefix}.{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            _hash_values(digest, tensor)
    return digest.hexdigest()


#: The modules of every model object an ``evaluate`` call holds now: id -> (the module, the call's thread).
_HELD: dict[int, tuple[Any, str]] = {}
_HELD_LOCK = threading.Lock()


@contextlib.contextmanager
def held_alone(model) -> Iterator[None]:
    """Hold ``model`` (a model object, or None: nothing to hold) for one ``evaluate`` call, from its first check to
    its last row. The call patches, probes and unpatches the object in place, so a second call on it (from another
    thread, or a model that shares a module with it: a ``PeftModel`` and its base model) would start from the
    first's patch and put the wrong state back; it is refused, naming the thread that holds the model."""
    if model is None:
        yield
        return
    modules = list(model.modules())
    with _HELD_LOCK:
        for module in modules:
            held = _HELD.get(id(module))
            if held is not None and held[0] is module:
                raise ValueError(f"model: this model object is being evaluated by another ctxext.evaluate call "
                                 f"(thread {held[1]!r}), which patches it in place; evaluate it after that call "
                                 "returns, or pass a copy (copy.deepcopy(model))")
        thread = threading.current_thread().name
        _HELD.update({id(module): (module, thread) for module in modules})
    try:
        yield
    finally:
        with _HELD_LOCK:
            for module in modules:
                _HELD.pop(id(module), None)


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

    info = {"model": _name(model), "object": type(model).__name__, "weights_sha256": weights_digest(model),
            "tokenizer_sample": _tokenizer_digest(tokenizer)}
    return ModelJob(label=_label(model), load_tokenizer=lambda: tokenizer, load_model=load,
                    load_skeleton=lambda: model, texts=texts, factor=factor, info=info, release=release)
