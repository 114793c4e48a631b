"""The training ability string, `codegym_v1@{env_id}@{config}`: a task as a dataset row names it.

`env_id` is `{code_id}__{EnvClass}`, `config` the task's config as JSON text. The string splits on
its first two `@` only: configs routinely hold `@` in their strings, env ids never do. The config
text is kept byte for byte (a row `codegym export` wrote holds it as published); what it means is
the runtime's to read (`codegym.contract.envstr.parse_ability` also parses the config and the env
id's parts).

The format lives here once, beside the action rule (`actions.py`), for everything that builds or
reads one: the trainer adapters, the drop-in environments, the servers and the command line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ABILITY_FORMAT",
    "ABILITY_PREFIX",
    "ability_env_id",
    "ability_parts",
    "is_ability",
    "make_ability",
    "split_ability",
]

ABILITY_PREFIX = "codegym_v1"
ABILITY_FORMAT = "codegym_v1@{code_id}__{Env}@{config}"  # for messages


def make_ability(env_id: str, config: str | Mapping[str, Any]) -> str:
    """The ability of a task: `config` as JSON text (kept as written) or a mapping (`json.dumps`)."""
    text = config if isinstance(config, str) else json.dumps(dict(config))
    return f"{ABILITY_PREFIX}@{env_id}@{text}"


def is_ability(text: str) -> bool:
    """Whether `text` is meant as an ability (it starts with the prefix), not an env string `Env@{json}`."""
    return text.startswith(f"{ABILITY_PREFIX}@")


def ability_parts(text: str) -> tuple[str, str, str]:
    """Prefix, env id and config text as written, unchecked ("" for a part that is missing): for
    readers that take many rows and check them elsewhere."""
    prefix, _, rest = text.partition("@")
    env_id, _, config = rest.partition("@")
    return prefix, env_id, config


def split_ability(text: str) -> tuple[str, str]:
    """(env id, config text) of an ability; ValueError saying what is wrong when `text` is not one."""
    prefix, sep, rest = text.partition("@")
    if not sep:
        raise ValueError(f"ability string has no '@': expected {ABILITY_FORMAT!r}, got {text[:80]!r}")
    if prefix != ABILITY_PREFIX:
        raise ValueError(f"ability prefix must be {ABILITY_PREFIX!r}, got {prefix!r}")
    env_id, sep, config = rest.partition("@")
    if not sep:
        raise ValueError(f"ability string has no config: expected {ABILITY_FORMAT!r}, got {text[:80]!r}")
    if not env_id:
        raise ValueError(f"ability string has no env id: expected {ABILITY_FORMAT!r}, got {text[:80]!r}")
    return env_id, config


def ability_env_id(text: str) -> str:
    """The env id of an ability (ValueError when `text` is not one)."""
    return split_ability(text)[0]
