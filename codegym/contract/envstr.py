"""Env strings (`Env@{json}`) and training ability strings (`codegym_v1@{code_id}__{Env}@{json}`).

Both split on the *first* `@` only, because configs routinely contain `@` in their strings. The
config is parsed as JSON first and as a Python literal second (CodeGym's own files write env
strings with Python literals), and must be an object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from codegym.contract.errors import EnvStringError
from codegym.inside import values

# The ability format is the client's (`codegym_client.abilities`): one definition for the trainers'
# side and the servers'. Re-exported here for the servers' modules that take it from the contract.
from codegym_client.abilities import ABILITY_PREFIX, make_ability, split_ability

__all__ = [
    "ABILITY_PREFIX",
    "Ability",
    "EnvString",
    "format_ability",
    "format_config",
    "format_env_str",
    "parse_ability",
    "parse_config",
    "parse_env_str",
    "split_env_id",
]

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class EnvString:
    env_class: str
    config: dict[str, Any]

    def format(self) -> str:
        return format_env_str(self.env_class, self.config)


@dataclass(frozen=True)
class Ability:
    code_id: str
    env_class: str
    config: dict[str, Any]

    @property
    def env_id(self) -> str:
        return f"{self.code_id}__{self.env_class}"

    @property
    def env_str(self) -> str:
        return format_env_str(self.env_class, self.config)

    def format(self) -> str:
        return format_ability(self.code_id, self.env_class, self.config)


def parse_config(text: str) -> dict[str, Any]:
    """A task config: a JSON object, or a Python dict literal, with string keys. The rule lives with
    the jail's code (`codegym.inside.values`), which builds environments from the same text."""
    try:
        return values.parse_config(text)
    except values.ConfigError as exc:
        raise EnvStringError(str(exc)) from None


def split_env_id(env_id: str) -> tuple[str, str]:
    """`{code_id}__{Env}` → (code_id, Env)."""
    code_id, sep, env_class = env_id.rpartition("__")
    if not sep or not code_id or not _IDENT.match(env_class):
        raise EnvStringError(f"env id {env_id!r} is not of the form {{code_id}}__{{EnvClass}}")
    return code_id, env_class


def parse_env_str(text: str) -> EnvString:
    name, sep, config = text.partition("@")
    if not sep:
        raise EnvStringError(f"env string has no '@': expected 'EnvClass@{{json}}', got {text[:80]!r}")
    name = name.strip()
    if not _IDENT.match(name):
        raise EnvStringError(f"env class {name!r} is not a Python identifier")
    return EnvString(name, parse_config(config))


def parse_ability(text: str) -> Ability:
    try:
        env_id, config = split_ability(text)
    except ValueError as exc:
        raise EnvStringError(str(exc)) from None
    code_id, env_class = split_env_id(env_id)
    return Ability(code_id, env_class, parse_config(config))


def format_config(config: dict[str, Any]) -> str:
    return json.dumps(config)


def format_env_str(env_class: str, config: dict[str, Any]) -> str:
    return f"{env_class}@{format_config(config)}"


def format_ability(code_id: str, env_class: str, config: dict[str, Any]) -> str:
    return make_ability(f"{code_id}__{env_class}", format_config(config))
