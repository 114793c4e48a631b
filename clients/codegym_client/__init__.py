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

from typing import TYPE_CHECKING, Any

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
from codegym_client.online import OnlineGymEnv
from codegym_client.requests import DEFAULT_TARGET, ActionLike, create_request, step_request
from codegym_client.runtime_client import RuntimeClient

if TYPE_CHECKING:
    from codegym_client.gym_env import RemoteEnv

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
    """`RemoteEnv` is imported on first use: it needs gymnasium, which only the `gym` extra brings."""
    if name == "RemoteEnv":
        from codegym_client.gym_env import RemoteEnv

        return RemoteEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
