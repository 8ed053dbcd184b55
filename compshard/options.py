"""Backend options: ``torch.compile(model, backend="compshard", options={...})``.

Options are data. :meth:`CompileOptions.from_dict` rejects unknown names and bad values
with an error that names the option and what is allowed, before anything is compiled.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

__all__ = ["CompileOptions"]


@dataclass(frozen=True)
class CompileOptions:
    """Options of the compshard backend.

    Attributes:
        codegen: ``"fx"`` runs the scheduled FX graphs as Python (fast to compile, the
            default); ``"inductor"`` hands them to Inductor for fused code.
        check_schedule: compare a fingerprint of every compiled schedule across ranks at
            compile time and raise on a mismatch (one small collective per graph).
        verify: check graph invariants after every pass (slower compiles; for debugging).
    """

    codegen: str = "fx"
    check_schedule: bool = True
    verify: bool = False

    _CHOICES = {"codegen": ("fx", "inductor")}

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "CompileOptions":
        options = dict(options or {})
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise ValueError(f"compshard: unknown option(s) {unknown}; allowed options are {allowed}")
        for name, value in options.items():
            default = getattr(cls, name)
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ValueError(f"compshard: option {name!r} must be True or False, got {value!r}")
            choices = cls._CHOICES.get(name)
            if choices is not None and value not in choices:
                raise ValueError(f"compshard: option {name!r} must be one of {list(choices)}, got {value!r}")
        return cls(**options)
