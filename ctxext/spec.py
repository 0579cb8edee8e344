"""The patch spec: what `patch()` did, recorded on the model config so it can be saved and reloaded."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

#: Key under which the active patch spec is stored in ``model.config``.
CONFIG_KEY = "ctxext"


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
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**known)
