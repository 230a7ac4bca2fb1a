"""The type check every setting goes through, read from its dataclass's annotations.

One path for the library's options and an application's config sections: ``int``, ``float``
(an int too; bool is no number), ``str``, a choice (a cnr.types.Choice enum: its string or member,
made the member), ``Optional[X]`` (None or an X), ``Dict[K, V]`` (every key a K, every value a V)
and a nested record (a dataclass, or a dict of its fields, e.g. ``failures``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any, Callable, Dict, Iterable, Mapping, Tuple

from cnr.options.naming import Naming, OptionsError, shown, values_of

_SCALARS: Dict[Any, Tuple[type, ...]] = {int: (int,), float: (int, float), str: (str,), bool: (bool,)}


@functools.lru_cache(maxsize=None)
def hints_of(cls: type) -> Dict[str, Any]:
    """Field name -> its resolved annotation, for dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def type_name(hint: Any) -> str:
    """How an error names what a setting must be: ``int``, ``float or None``, ``Dict[str, int]``."""
    if hint in _SCALARS:
        return hint.__name__
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union:
        return " or ".join("None" if a is type(None) else type_name(a) for a in args)
    if typing.get_origin(hint) is dict:
        return f"Dict[{type_name(args[0])}, {type_name(args[1])}]"
    return getattr(hint, "__name__", str(hint))


def _fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of scalar or mapping type ``hint`` (the items of a Dict included)."""
    if hint in _SCALARS:
        return isinstance(value, _SCALARS[hint]) and (hint is bool or not isinstance(value, bool))
    if typing.get_origin(hint) is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_fits(key, k) and _fits(item, v) for k, v in value.items())
    return isinstance(value, hint)


def _is_choice(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def checked(name: str, hint: Any, value: Any, names: Naming, convert: bool) -> Any:
    """``value`` of setting ``name`` checked against ``hint``; with ``convert``, a choice's string
    made its enum member and a record's dict made the record. Raises ``names.error`` naming the
    setting, the value and what it must be (a choice: every allowed value)."""
    if typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in typing.get_args(hint):
            return None
        inner = [h for h in typing.get_args(hint) if h is not type(None)]
        if len(inner) == 1 and (_is_choice(inner[0]) or dataclasses.is_dataclass(inner[0])):
            return checked(name, inner[0], value, names, convert)  # it names the choices or the record
        names.require(any(_fits(h, value) for h in inner),
                      f"{names.subject(name)} = {shown(value)} is not allowed; it must be {type_name(hint)}")
        return value
    if _is_choice(hint):
        names.one_of(name, value, values_of(hint))
        return hint(value) if convert else value
    if dataclasses.is_dataclass(hint):
        if convert and isinstance(value, Mapping):
            value = hint.from_mapping(value, names)
        names.require(isinstance(value, hint), f"{names.subject(name)} = {shown(value):.80} is not allowed; give a "
                      f"cnr.{hint.__name__} or a dict of its fields")
        check_record(value, names.within(name), convert=False)
        return value
    names.require(_fits(hint, value), f"{names.subject(name)} = {shown(value)} is not allowed; it must be "
                  f"{type_name(hint)}")
    return value


def check_record(obj: Any, names: Naming, convert: bool = True, cls: Any = None,
                 skip: Iterable[str] = ()) -> None:
    """Every field of ``obj`` (an instance of dataclass ``cls``, default its own type; or any object
    holding ``cls``'s fields, e.g. an application's config section) checked against its annotation.
    With ``convert`` (``obj`` a frozen dataclass of its own), values are replaced by what
    ``checked`` makes of them. ``skip``: fields not checked."""
    for name, hint in hints_of(cls or type(obj)).items():
        if name in skip:
            continue
        value = getattr(obj, name)
        made = checked(name, hint, value, names, convert)
        if convert and made is not value:
            object.__setattr__(obj, name, made)


def strict_init(cls: type, belongs: Callable[[str], str]) -> type:
    """Make dataclass ``cls``'s constructor refuse an unknown keyword with an OptionsError naming it,
    where it belongs (``belongs(key)``: e.g. "it is RetentionOptions.keep_last", or "") and the
    keywords ``cls`` takes, rather than with a bare TypeError."""
    init = cls.__init__
    allowed = [f.name for f in dataclasses.fields(cls)]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = sorted((k for k in kwargs if k not in allowed), key=str)
        if unknown:
            where = belongs(unknown[0])
            raise OptionsError(f"{cls.__name__} takes no setting {shown(unknown[0])}" + (f" ({where})" if where else "")
                               + f"; allowed: {', '.join(allowed)}")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[assignment]
    return cls
