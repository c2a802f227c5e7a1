"""Config files as pydantic models: a typo in a key, or a value of the wrong kind, is a ValueError that
names the file and the key (`tasks.max_drop: expected a number, got None`), never a silent default."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """A config section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def validate_config(model: type[M], data: Any, source: str, error: type[ValueError] = ValueError) -> M:
    """`data` as `model`; `error` "<source>: <key>: <problem>" for the first problem otherwise."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise error(f"{source}: {describe_error(model, exc.errors()[0])}") from None


def _section_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The model that holds the field at `loc` (None when the path leaves the models)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(str(part))
            current = None if info is None else info.annotation
        else:  # a dict of sections (`overrides.<task>`): the values' model
            args = [get_args(a)[0] if get_origin(a) is Annotated else a for a in get_args(current)]
            current = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def describe_error(model: type[BaseModel], err: dict) -> str:
    loc = tuple(p for p in err["loc"] if not str(p).startswith("function-"))
    key = ".".join(str(p) for p in loc)
    kind, value = err["type"], err.get("input")
    if kind == "extra_forbidden":
        holder = _section_model(model, loc)
        allowed = ", ".join(holder.model_fields) if holder else "?"
        where = "; unknown top-level keys are refused" if len(loc) == 1 else f" of {'.'.join(map(str, loc[:-1]))}"
        return f"unknown key {key!r} (unknown field{where}; allowed here: {allowed})"
    if kind in ("value_error", "assertion_error"):
        problem = str(err["ctx"]["error"])
    elif kind == "missing":
        problem = "required"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        problem = f"expected a mapping, got {type(value).__name__} {value!r}"
    else:
        problem = f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}"
    return f"{key}: {problem}" if key else problem
