"""The environment contract: static reading, rendering and checking of environment sources."""

from codegym.contract.answers import answers_equal, canonical, canonical_json
from codegym.contract.envstr import (
    Ability,
    EnvString,
    format_ability,
    format_env_str,
    parse_ability,
    parse_config,
    parse_env_str,
    split_env_id,
)
from codegym.contract.errors import ContractError, EnvStringError, Violation
from codegym.contract.render import tool_schema, tool_text, tools_schema, tools_schema_json, tools_text
from codegym.contract.safety import Finding, scan_source
from codegym.contract.source import EnvSpec, ToolDef, analyze_source, parse_env_source, sha256_text

__all__ = [
    "Ability",
    "ContractError",
    "EnvSpec",
    "EnvString",
    "EnvStringError",
    "Finding",
    "ToolDef",
    "Violation",
    "analyze_source",
    "answers_equal",
    "canonical",
    "canonical_json",
    "format_ability",
    "format_env_str",
    "parse_ability",
    "parse_config",
    "parse_env_source",
    "parse_env_str",
    "scan_source",
    "sha256_text",
    "split_env_id",
    "tool_schema",
    "tool_text",
    "tools_schema",
    "tools_schema_json",
    "tools_text",
]
