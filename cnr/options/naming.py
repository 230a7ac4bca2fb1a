"""How the checks of cnr's settings name what they refuse (``Naming``) and quote it (``shown``).

A check takes a ``Naming``, so that the library's options and an application that reads the same
settings from its own configuration (``cnr train``'s ``checkpoint`` and ``publish`` sections)
refuse a bad value by the same rule, each naming the setting its own way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence, Tuple

from cnr.errors import ConfigError

MAX_SHOWN = 200  # characters of a bad value quoted in an error message


class OptionsError(ConfigError, ValueError):
    """A CheckpointOptions value is not allowed (a ValueError too, as Python APIs raise)."""


def shown(value: Any) -> str:
    """``repr(value)``, cut to MAX_SHOWN characters: an error never quotes a huge value whole. A
    choice given as an enum member (cnr.types.Choice) is quoted as its string, as it was typed."""
    text = repr(value.value if isinstance(value, enum.Enum) else value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}... ({len(text)} characters)"


def values_of(choices: "type[enum.Enum]") -> Tuple[str, ...]:
    """The string values an enum of choices accepts, in declaration order."""
    return tuple(m.value for m in choices)


@dataclass(frozen=True)
class Naming:
    """How a check names the settings in its errors: ``prefix`` + the setting's name, e.g.
    ``CheckpointOptions.bits``; with ``config_keys`` as a config file's key,
    ``config key 'checkpoint.bits'``. ``error``: the exception raised."""

    prefix: str
    config_keys: bool = False
    error: type = OptionsError

    def ref(self, name: str) -> str:
        """Another setting, mentioned in an error."""
        return self.prefix + name

    def subject(self, name: str) -> str:
        """The setting being rejected."""
        return f"config key {self.ref(name)!r}" if self.config_keys else self.ref(name)

    def within(self, name: str) -> "Naming":
        """The naming of the fields of setting ``name`` (a record such as ``failures``)."""
        return Naming(self.ref(name + "."), self.config_keys, self.error)

    def require(self, ok: bool, message: str) -> None:
        if not ok:
            raise self.error(message)

    def one_of(self, name: str, value: Any, allowed: Sequence[str]) -> None:
        choices = ", ".join(a if a else "'' (the default)" for a in allowed)
        self.require(isinstance(value, str) and value in allowed,
                     f"{self.subject(name)} = {shown(value)} is not allowed; allowed: {choices}")

    def positive(self, name: str, value: float) -> None:
        self.require(value > 0, f"{self.subject(name)} = {value!r} is not allowed; it must be > 0")


CHECKPOINT_OPTIONS = Naming("CheckpointOptions.")
PUBLISH_OPTIONS = Naming("PublishOptions.")
