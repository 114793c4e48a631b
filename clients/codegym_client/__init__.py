"""The CodeGym client: what an RL trainer installs (`pip install ./clients`) and imports.

    from codegym_client import RuntimeClient, AsyncRuntimeClient, OnlineGymEnv, RemoteEnv

Modules, one concern each:

- `runtime_client`: `RuntimeClient` (blocking); `async_client`: `AsyncRuntimeClient`, `StepStream`.
- `online`: `OnlineGymEnv`, a drop-in for CodeGym's online client; `gym_env`: `RemoteEnv`, a
  `gymnasium.Env` over one session (needs the `gym` extra: `pip install './clients[gym]'`).
- `actions`: model output (`<|FunctionCallBegin|>` blocks, OpenAI `tool_calls`) to actions;
  `abilities`: the training ability string `codegym_v1@{env_id}@{config}`, built and read.
- `errors`: the typed errors and the one failure table (what is retried, resent, waited out or
  trained on); `typed_calls`: client methods whose gRPC failures come out typed.
- `resend`: how a call whose reply was lost is sent again without being applied twice;
  `outages`: how a trainer adapter waits out an outage (`ride_out`, the shared `Outage` clock).
- `trl`, `verl`: the trainer adapters (TRL's `environment_factory`, verl's agent loop and tool).
- `requests`: the requests built from a trainer's arguments; `channels`: the channel factory.
- `api`: the runtime API's messages and stubs, generated from `protos/` by `make proto`.

Nothing here imports the servers: the package needs grpcio and protobuf only.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each name is imported on first use (PEP 562): `import codegym_client.defaults` (a command
# line's --help) does not load gRPC, and `RemoteEnv` needs gymnasium, which only the `gym` extra
# brings.
_HOMES = {
    "Action": "codegym_client.actions",
    "ActionLike": "codegym_client.requests",
    "ActionParseError": "codegym_client.actions",
    "AsyncRuntimeClient": "codegym_client.async_client",
    "CapacityExceeded": "codegym_client.errors",
    "CodeGymError": "codegym_client.errors",
    "NoHistory": "codegym_client.errors",
    "CodeGone": "codegym_client.errors",
    "EpisodeNotFound": "codegym_client.errors",
    "CheckpointsOff": "codegym_client.errors",
    "BadCheckpoint": "codegym_client.errors",
    "DEFAULT_TARGET": "codegym_client.requests",
    "EnvFailed": "codegym_client.errors",
    "EnvNotFound": "codegym_client.errors",
    "EpisodeEnded": "codegym_client.errors",
    "EpisodeFailed": "codegym_client.errors",
    "InfrastructureFailure": "codegym_client.errors",
    "InvalidRequest": "codegym_client.errors",
    "OnlineGymEnv": "codegym_client.online",
    "PermissionDenied": "codegym_client.errors",
    "RemoteEnv": "codegym_client.gym_env",
    "RuntimeClient": "codegym_client.runtime_client",
    "RuntimeUnavailable": "codegym_client.errors",
    "SessionDone": "codegym_client.errors",
    "SessionNotFound": "codegym_client.errors",
    "StepConflict": "codegym_client.errors",
    "StepStream": "codegym_client.async_client",
    "Unauthenticated": "codegym_client.errors",
    "create_request": "codegym_client.requests",
    "from_tool_calls": "codegym_client.actions",
    "is_infrastructure": "codegym_client.errors",
    "parse_function_call": "codegym_client.actions",
    "parse_function_calls": "codegym_client.actions",
    "step_request": "codegym_client.requests",
    "tool_call_action": "codegym_client.actions",
}

if TYPE_CHECKING:
    from codegym_client.actions import (
        Action,
        ActionParseError,
        from_tool_calls,
        parse_function_call,
        parse_function_calls,
        tool_call_action,
    )
    from codegym_client.async_client import AsyncRuntimeClient, StepStream
    from codegym_client.errors import (
        BadCheckpoint,
        CapacityExceeded,
        CheckpointsOff,
        CodeGone,
        CodeGymError,
        EnvFailed,
        EnvNotFound,
        EpisodeEnded,
        EpisodeFailed,
        EpisodeNotFound,
        InfrastructureFailure,
        InvalidRequest,
        NoHistory,
        PermissionDenied,
        RuntimeUnavailable,
        SessionDone,
        SessionNotFound,
        StepConflict,
        Unauthenticated,
        is_infrastructure,
    )
    from codegym_client.gym_env import RemoteEnv
    from codegym_client.online import OnlineGymEnv
    from codegym_client.requests import DEFAULT_TARGET, ActionLike, create_request, step_request
    from codegym_client.runtime_client import RuntimeClient

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGET",
    "Action",
    "ActionLike",
    "ActionParseError",
    "AsyncRuntimeClient",
    "BadCheckpoint",
    "CapacityExceeded",
    "CheckpointsOff",
    "CodeGone",
    "CodeGymError",
    "EnvFailed",
    "EnvNotFound",
    "EpisodeEnded",
    "EpisodeFailed",
    "EpisodeNotFound",
    "InfrastructureFailure",
    "InvalidRequest",
    "NoHistory",
    "OnlineGymEnv",
    "PermissionDenied",
    "RemoteEnv",
    "RuntimeClient",
    "RuntimeUnavailable",
    "SessionDone",
    "SessionNotFound",
    "StepConflict",
    "StepStream",
    "Unauthenticated",
    "create_request",
    "from_tool_calls",
    "is_infrastructure",
    "parse_function_call",
    "parse_function_calls",
    "step_request",
    "tool_call_action",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
