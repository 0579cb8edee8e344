"""The patch spec: what `patch()` did, recorded on the model config so it can be saved and reloaded.

Where the patch has an exact transformers-native form, ``model.save_pretrained`` writes that form instead
(``ctxext.export``): the native config values (e.g. rope type ``yarn``) at the top level, plain transformers loads
the patched model, and the spec block says ``"saved_as": "native"`` and keeps the values it replaced. Otherwise a
config that records a spec is written to JSON *marked* (principle 9: a patched checkpoint never loads silently
different). ``config.json`` of a patched model carries ``model_type: "<type> patched by ctxext: load it with
ctxext.from_pretrained(path)"``, which transformers' ``AutoConfig`` / ``AutoModel*`` / pipelines (and serving engines
that read ``config.json``) refuse, naming ``ctxext.from_pretrained`` in their error; a rotary config also gets that
text as its ``rope_type``, so a class-specific load (``LlamaForCausalLM.from_pretrained``) fails too. The replaced
values are kept in the spec block (``replaced_on_save``); ``ctxext.from_pretrained`` / ``ctxext.loading.load_config``
put them back and re-apply the patch. The mark exists only in the JSON: the live config, ``config.to_dict()`` and the
patched model's behaviour are unchanged. It is applied in ``PreTrainedConfig.to_json_string``, which
``save_pretrained``, ``push_to_hub`` and ``config.save_pretrained`` all write through, so it holds whatever the user
calls.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

#: Key under which the active patch spec is stored in ``model.config``.
CONFIG_KEY = "ctxext"
#: Key in the saved spec block holding the config values the save mark replaced.
REPLACED_KEY = "replaced_on_save"
#: What a user who loads a saved patched model with plain transformers is told.
LOAD_HINT = "load it with ctxext.from_pretrained(path)"
#: Key in the live spec block, present only while ``model.save_pretrained`` writes the patch's native form
#: (``ctxext.export``): the top-level config values to write instead of marking the config.
NATIVE_KEY = "native"
#: Key in the saved spec block of a native export whose weights differ from the original model's (GPT-2's resized
#: table): the file beside the weights holding the tensors they replaced.
TENSORS_KEY = "native_tensors"
#: Key in the spec block, present (True) where the model's config had no length attribute before the patch (BLOOM):
#: a reload then leaves it absent, so that ``unpatch`` gives the config it had, as it does without a save.
LENGTH_ABSENT_KEY = "length_attr_absent"
#: Key in the saved spec block: ``"native"`` where the checkpoint was written in its native form (plain transformers
#: loads it as the patched model); absent where it was marked.
SAVED_AS_KEY = "saved_as"


@dataclass(frozen=True)
class PatchSpec:
    method: str
    factor: float | None
    options: dict[str, Any] = field(default_factory=dict)
    family: str = ""
    #: The context length the model advertised before the patch.
    original_length: int | None = None
    #: The length advertised after the patch (``factor * original_length`` where a factor applies).
    patched_length: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PatchSpec":
        """A spec read back from a saved config (or ``ctxext_patch.json``); a block edited by hand or damaged is a
        PatchError naming the field, never a spec that silently patches differently. Keys it does not know (the
        save mark's own) are left to their readers."""
        from .errors import PatchError

        if not isinstance(data, dict):
            raise PatchError(f"a saved ctxext patch spec must be a mapping, got {type(data).__name__}")
        missing = [k for k in ("method", "factor", "original_length") if k not in data]
        if missing:
            raise PatchError(f"the saved ctxext patch spec lacks {', '.join(missing)} (it holds "
                             f"{', '.join(sorted(map(str, data))) or 'nothing'}); save the patched model again")
        checks = {
            "method": lambda v: isinstance(v, str) and v.strip() != "",
            "factor": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)),
            "options": lambda v: isinstance(v, dict),
            "family": lambda v: isinstance(v, str),
            "original_length": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "patched_length": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        }
        for key, fits in checks.items():
            if key in data and not fits(data[key]):
                raise PatchError(f"the saved ctxext patch spec has {key}={data[key]!r}, which no patch writes; "
                                 "save the patched model again")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


# -- the save mark --------------------------------------------------------------------------------------------------


def _is_mark(value: Any) -> bool:
    return isinstance(value, str) and LOAD_HINT in value


def _marked_rope(rope: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` with every ``rope_type`` replaced by the hint (one dict, or one per layer type)."""
    if "rope_type" in rope:
        return {**rope, "rope_type": f"ctxext: {LOAD_HINT}"}
    if rope and all(isinstance(v, dict) and "rope_type" in v for v in rope.values()):
        return {k: {**v, "rope_type": f"ctxext: {LOAD_HINT}"} for k, v in rope.items()}
    return None


def is_marked(config_dict: dict[str, Any]) -> bool:
    block = config_dict.get(CONFIG_KEY)
    return isinstance(block, dict) and REPLACED_KEY in block


def is_native(config_dict: dict[str, Any]) -> bool:
    """A config.json written in the patch's native form (plain transformers loads it as the patched model)."""
    block = config_dict.get(CONFIG_KEY)
    return isinstance(block, dict) and block.get(SAVED_AS_KEY) == "native"


def native_config_dict(config_dict: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    """The serialized config of a patched model in its native form: the block's ``NATIVE_KEY`` values written at
    the top level, the values they replaced (``live``: the live config's) kept in ``replaced_on_save`` so that
    ``ctxext.from_pretrained`` re-applies the patch from the original config."""
    data = dict(config_dict)
    block = dict(data[CONFIG_KEY])
    changes = block.pop(NATIVE_KEY)
    block.pop(REPLACED_KEY, None)
    block[REPLACED_KEY] = {key: copy.deepcopy(live.get(key)) for key in changes}
    block[SAVED_AS_KEY] = "native"
    data.update(copy.deepcopy(changes))
    data[CONFIG_KEY] = block
    return data


def mark_config_dict(config_dict: dict[str, Any], live: dict[str, Any] | None = None) -> dict[str, Any]:
    """The serialized config of a patched model, marked so that plain transformers refuses to load it (or, while
    ``model.save_pretrained`` writes a native form, that form: see :func:`native_config_dict`; ``live`` is the
    live config's ``__dict__``). A dict without a spec block is returned unchanged."""
    block = config_dict.get(CONFIG_KEY)
    if not isinstance(block, dict):
        return config_dict
    if NATIVE_KEY in block:
        return native_config_dict(config_dict, live if live is not None else config_dict)
    if block.get(SAVED_AS_KEY) == "native":
        # a native export loaded by plain transformers and saved again: still that native checkpoint (marking it
        # would record its already-scaled RoPE as the original, and a reload would apply the patch twice)
        return config_dict
    data = dict(config_dict)
    block = dict(block)
    before = block.pop(REPLACED_KEY, None) or {}  # a config loaded marked (class-specific load) and saved again
    replaced: dict[str, Any] = {}
    model_type = data.get("model_type")
    if _is_mark(model_type):
        model_type = before.get("model_type")
    if model_type:
        replaced["model_type"] = model_type
        data["model_type"] = f"{model_type} patched by ctxext: {LOAD_HINT}"
    rope = data.get("rope_parameters")
    if isinstance(rope, dict):  # the 5.x RoPE settings
        if _is_mark(json.dumps(rope)) and "rope_parameters" in before:
            rope = before["rope_parameters"]
        marked = _marked_rope(rope)
        if marked is not None:
            replaced["rope_parameters"] = copy.deepcopy(rope)
            data["rope_parameters"] = marked
    elif "rope_scaling" in data and ("rope_theta" in data or "rotary_emb_base" in data):
        # the 4.x RoPE settings: rope_theta (rotary_emb_base) + rope_scaling, None for plain RoPE; a rope_type 4.x
        # does not know makes its rotary module fail with the hint (KeyError) on a class-specific load
        scaling = data["rope_scaling"]
        if _is_mark(json.dumps(scaling)) and "rope_scaling" in before:
            scaling = before["rope_scaling"]
        replaced["rope_scaling"] = copy.deepcopy(scaling)
        data["rope_scaling"] = {**(scaling or {}), "rope_type": f"ctxext: {LOAD_HINT}"}
    block[REPLACED_KEY] = replaced
    block.pop(SAVED_AS_KEY, None)
    data[CONFIG_KEY] = block
    return data


def unmark_config_dict(config_dict: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`mark_config_dict`: the config as the patched model had it (the spec block stays)."""
    if not is_marked(config_dict):
        return config_dict
    data = dict(config_dict)
    block = dict(data[CONFIG_KEY])
    replaced = block.pop(REPLACED_KEY)
    if not isinstance(replaced, dict):  # empty where the native form changed no top-level value (BLOOM's)
        from .errors import PatchError

        raise PatchError(f"the saved ctxext patch spec has {REPLACED_KEY}={replaced!r}: the config values the save "
                         "replaced are lost; save the patched model again")
    data.update(copy.deepcopy(replaced))
    block.pop(SAVED_AS_KEY, None)
    block.pop(TENSORS_KEY, None)
    data[CONFIG_KEY] = block
    return data


def unmark_live_config(config: Any) -> None:
    """A config built from a marked ``config.json`` without ctxext (e.g. ``GPT2LMHeadModel.from_pretrained``): put
    back the values the mark replaced."""
    block = vars(config).get(CONFIG_KEY)
    if not isinstance(block, dict) or REPLACED_KEY not in block:
        return
    block = dict(block)
    block.pop(SAVED_AS_KEY, None)
    block.pop(TENSORS_KEY, None)
    for key, value in (block.pop(REPLACED_KEY) or {}).items():
        if key == "model_type":
            if _is_mark(vars(config).get("model_type")):
                delattr(config, "model_type")  # the class attribute is the real one
        else:
            setattr(config, key, copy.deepcopy(value))
    setattr(config, CONFIG_KEY, block)


def transformers_config_class():
    import transformers

    return getattr(transformers, "PreTrainedConfig", None) or getattr(transformers, "PretrainedConfig", None)


def install_save_mark() -> bool:
    """Wrap ``PreTrainedConfig.to_json_string`` once so that a config recording a ctxext spec is written marked.
    Returns False where transformers has no such method (``patch`` then refuses: it could not keep its promise)."""
    base = transformers_config_class()
    original = getattr(base, "to_json_string", None) if base is not None else None
    if not callable(original):
        return False
    if getattr(original, "_ctxext_mark", False):
        return True

    @functools.wraps(original)
    def to_json_string(self, *args, **kwargs):
        text = original(self, *args, **kwargs)
        if not isinstance(vars(self).get(CONFIG_KEY), dict):
            return text
        return json.dumps(mark_config_dict(json.loads(text), vars(self)), indent=2, sort_keys=True) + "\n"

    to_json_string._ctxext_mark = True
    base.to_json_string = to_json_string
    return True
