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
import math
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
#: The values of ``SAVED_AS_KEY`` this ctxext writes.
SAVED_AS_VALUES = ("native",)
#: Key in the saved spec block: the version of the record's format, written since version 1 (a record without it is
#: version 1). A record of a later version comes from a newer ctxext and is refused, naming it, not read in part.
VERSION_KEY = "version"
RECORD_VERSION = 1
#: The keys a saved record may hold besides the spec's own fields; any other key is refused by name.
RECORD_KEYS = (REPLACED_KEY, SAVED_AS_KEY, TENSORS_KEY, LENGTH_ABSENT_KEY, VERSION_KEY)


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
        """The record of the patch (``describe``, the saved config, the evaluator's rows): its fields, with the
        options it ran with, so a default the method derives from the original length and the factor reads as its
        value (Self-Extend's group and window), not None. ``options`` itself stays as asked: the checks read what the
        user gave (a shipped DCA config refuses dca's defaults, not the same values given). A record reloads to the
        same patch: the derived values are what the defaults give."""
        data = asdict(self)
        data["options"] = self._options_run()
        return data

    def _options_run(self) -> dict[str, Any]:
        from ..methods.registry import METHODS, derived_options  # the methods import core: not at the top
        from .errors import PatchError

        method = METHODS.get(self.method)
        if method is None:
            return copy.deepcopy(self.options)
        try:
            return derived_options(method, copy.deepcopy(self.options), original_length=self.original_length,
                                   factor=self.factor)
        except (PatchError, TypeError):  # a record no patch wrote: refused where it is applied, not where it is read
            return copy.deepcopy(self.options)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "") -> "PatchSpec":
        """A spec read back from a saved config (or ``ctxext_patch.json``); a block edited by hand or damaged is a
        PatchError saying that the record is damaged and naming the key, never a spec that silently patches
        differently. A record from a newer ctxext (a later ``version``, keys or a ``saved_as`` this one does not know)
        is refused, naming them. The save mark's own keys (``RECORD_KEYS``) are checked here and left to their
        readers. ``where``: the file, for the message (`` in DIR/config.json``)."""
        from .errors import PatchError

        check_record(data, where)
        missing = [k for k in ("method", "factor", "original_length") if k not in data]
        if missing:
            raise PatchError(f"the ctxext record{where} is damaged: it lacks {', '.join(missing)} (it holds "
                             f"{', '.join(sorted(map(str, data))) or 'nothing'}); save the patched model again")
        checks = {
            "method": lambda v: isinstance(v, str) and v.strip() != "",
            "factor": lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                              and math.isfinite(v)),
            "options": lambda v: isinstance(v, dict),
            "family": lambda v: isinstance(v, str),
            "original_length": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "patched_length": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
        }
        for key, fits in checks.items():
            if key in data and not fits(data[key]):
                raise PatchError(f"the ctxext record{where} is damaged: {key}={data[key]!r}, which no patch writes; "
                                 "save the patched model again")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)


def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first non-finite number (NaN, inf) in ``value``, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    if isinstance(value, dict):
        return next((p for k, v in value.items() if (p := _non_finite(v, f"{path}.{k}")) is not None), None)
    if isinstance(value, list):
        return next((p for i, v in enumerate(value) if (p := _non_finite(v, f"{path}[{i}]")) is not None), None)
    return None


def check_record(data: Any, where: str = "") -> None:
    """Refuse a saved ctxext record (the ``ctxext`` block of a config.json, or ``ctxext_patch.json``) that this
    ctxext cannot read as written: not a mapping, a later ``version``, keys or a ``saved_as`` it does not know, or a
    key of the save mark with a value no save writes. PatchError saying which key (and version)."""
    from .errors import PatchError

    if not isinstance(data, dict):
        shown = json.dumps(data, default=repr)[:60]
        raise PatchError(f"the ctxext record{where} is damaged: it is {shown}, not a mapping of the patch's "
                         "settings; save the patched model again")
    fields = set(PatchSpec.__dataclass_fields__)
    unknown = sorted(str(k) for k in data if k not in fields and k not in RECORD_KEYS)
    if VERSION_KEY in data:
        version = data[VERSION_KEY]
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise PatchError(f"the ctxext record{where} is damaged: {VERSION_KEY}={version!r}, which no ctxext writes "
                             "(a whole number >= 1); save the patched model again")
        if version > RECORD_VERSION:
            also = f", with keys it does not know: {', '.join(unknown)}" if unknown else ""
            raise PatchError(f"the ctxext record{where} was written by a newer ctxext (record version {version}; this "
                             f"ctxext reads version {RECORD_VERSION}{also}); upgrade ctxext to load it")
    if unknown:
        raise PatchError(f"the ctxext record{where} holds keys this ctxext does not know: {', '.join(unknown)} "
                         "(written by a newer ctxext, or edited by hand); upgrade ctxext, or save the patched model "
                         "again")
    saved_as = data.get(SAVED_AS_KEY)
    if SAVED_AS_KEY in data and saved_as not in SAVED_AS_VALUES:
        raise PatchError(f"the ctxext record{where} has {SAVED_AS_KEY}={saved_as!r}, which this ctxext does not know "
                         f"(it writes {', '.join(map(repr, SAVED_AS_VALUES))}; a newer ctxext's?); upgrade ctxext, or "
                         "save the patched model again")
    types_ = {REPLACED_KEY: (dict, "a mapping"), TENSORS_KEY: (str, "a file name"),
              LENGTH_ABSENT_KEY: (bool, "true")}
    for key, (kind, what) in types_.items():
        if key in data and not isinstance(data[key], kind):
            raise PatchError(f"the ctxext record{where} is damaged: {key}={data[key]!r}, where a save writes {what}; "
                             "save the patched model again")
    bad = _non_finite(data.get(REPLACED_KEY), REPLACED_KEY)  # the original config values a load puts back
    if bad is not None:
        raise PatchError(f"the ctxext record{where} is damaged: {bad} is not a finite number; save the patched "
                         "model again")


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


def check_saved_config(config_dict: dict[str, Any], where: str = "") -> None:
    """The ctxext record of a ``config.json`` (``where``: the file, for the message), before anything loads from it:
    the record itself (:func:`check_record`, then the spec's fields), and the save mark's bookkeeping: every value the
    mark replaced (a ``model_type`` or rope type naming ``ctxext.from_pretrained``) kept in ``replaced_on_save``, and
    a native export's ``replaced_on_save`` present (the original values ``unpatch`` gives back). PatchError saying
    that the record is damaged, and which key."""
    from .errors import PatchError

    block = config_dict.get(CONFIG_KEY)
    PatchSpec.from_dict(block, where)  # check_record first: a mapping, a version and keys this ctxext reads
    marked = [key for key in ("model_type", "rope_parameters", "rope_scaling")
              if key in config_dict and LOAD_HINT in json.dumps(config_dict[key])]
    native = block.get(SAVED_AS_KEY) == "native"
    if REPLACED_KEY not in block and (marked or native):
        what = "the export replaced" if native else f"the save mark replaced ({', '.join(marked)})"
        raise PatchError(f"the ctxext record{where} is damaged: it lacks {REPLACED_KEY}, the config values {what}, "
                         "which a load puts back; save the patched model again")
    lost = [key for key in marked if key not in block.get(REPLACED_KEY, {})]
    if lost:
        raise PatchError(f"the ctxext record{where} is damaged: {REPLACED_KEY} lacks {', '.join(lost)}, which the "
                         "save mark replaced in the config; save the patched model again")


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
    block[VERSION_KEY] = RECORD_VERSION
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
    block[VERSION_KEY] = RECORD_VERSION
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
