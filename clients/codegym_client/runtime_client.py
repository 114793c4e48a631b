"""`RuntimeClient`, the blocking client of the runtime service, for trainers.

Deadlines and retries are set once, on the channel (`codegym_client.channels`): every call gets
`timeout_s`, and the channel retries UNAVAILABLE (a replica restarting, a connection reset) except
for Step and BatchStep, which change a session and must not be applied twice by a blind retry.
Steps, creates and resets are resent here instead, safely, with the session's step index
(`codegym_client.resend`). A call the runtime refuses raises the `CodeGymError` of its reason
(`codegym_client.errors`). Per-entry codes of `BatchStep` answers stay in the answers (`code`,
`message`).

Each step is one unary `Step` call: this client is used from many threads, each blocking on its
call, where a shared stream would need a thread of its own to read answers. The asyncio client
(`AsyncRuntimeClient`) sends its steps over shared `StepStream` calls instead
(`codegym_client.step_streams`), which costs the runtime less per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import (
    HEALTH_CHECK,
    HEALTH_REQUEST,
    PROBE_TIMEOUT_S,
    Access,
    sync_channel,
    target_text,
)
from codegym_client.errors import SessionNotFound, typed_error
from codegym_client.requests import (
    DEFAULT_TARGET,
    NOT_RETRIED,
    SERVICE,
    ActionLike,
    checkpoint_request,
    create_request,
    fork_request,
    restore_request,
    sample_request,
)
from codegym_client.resend import (
    DEFAULT_ATTEMPTS,
    Attempts,
    PendingBatch,
    StepIndexes,
    resend_kind,
    step_requests,
)
from codegym_client.typed_calls import raises_typed, unreachable

__all__ = ["RuntimeClient"]


R = TypeVar("R")


class RuntimeClient:
    """Blocking client; thread-safe (one channel, many threads). Failed calls raise `CodeGymError`s.

    `timeout_s` is each send's deadline; a step (or batch step) of a session this client created gets
    at least twice the session's step timeout and 10 s more (`resend.RUNS_PER_STEP`). `attempts`: how
    many times a step, create or reset is sent at most when its reply is lost (1: never resent).
    See `codegym_client.resend`. `token`: the access token sent with every call (`CODEGYM_TOKEN` when
    None); `tls_ca`: the PEM file of the CA that signed the runtime's certificate, which turns TLS
    on (`CODEGYM_TLS_CA` when None); `access`: both at once, as a command line reads them (then
    `token` and `tls_ca` are not read). A refused token raises `Unauthenticated` or `PermissionDenied`.
    Every step is one unary `Step` call (unlike `AsyncRuntimeClient`'s, sent over shared streams).
    """

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        timeout_s: float = 30.0,
        attempts: int = DEFAULT_ATTEMPTS,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        access: Access | None = None,
    ) -> None:
        self.target = target_text(target)
        access = access or Access.from_env(token, tls_ca)
        self.channel = sync_channel(target, [SERVICE], no_retry=NOT_RETRIED, access=access)
        self.stub = rt_grpc.RuntimeServiceStub(self.channel)
        self.timeout_s = timeout_s
        self.attempts = max(1, attempts)
        self.indexes = StepIndexes()
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self.channel.close()

    def __enter__(self) -> RuntimeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel is connected; `RuntimeUnavailable` (with the cause) if it is not."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            return
        except grpc.FutureTimeoutError:
            pass
        probe = self.channel.unary_unary(HEALTH_CHECK)  # raw bytes: see HEALTH_REQUEST
        try:  # one quick call, for the reason (a connection refused, an unknown host...)
            probe(HEALTH_REQUEST, timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError as exc:
            error = unreachable(self.target, timeout_s, exc)
            if error is not None:
                raise error from None

    def _send(self, method: str, call: Callable[[bool], R], *, repeatable: bool) -> R:
        """`call(first)`, sent again while its reply may have been lost and the budget lasts."""
        budget = Attempts(self.attempts)
        while True:
            try:
                return call(budget.sent == 0)
            except grpc.RpcError as exc:
                error = typed_error(exc, method)
                delay = None if self._closed else budget.again(resend_kind(error, repeatable))
                if delay is None:
                    raise error from exc
            time.sleep(delay)

    @raises_typed("CreateSession")
    def create_session(self, **kwargs: Any) -> rt.CreateSessionResponse:
        """See `create_request` for the arguments (ability, or env_id + config, or env_str)."""
        request = create_request(**kwargs)
        response: rt.CreateSessionResponse = self._send(
            "CreateSession",
            lambda _: self.stub.CreateSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        self.indexes.created(response)
        return response

    @raises_typed("Step")
    def step(self, session_id: str, action: ActionLike, *, step_index: int | None = None) -> rt.StepResponse:
        """One step. A step whose reply is lost is sent again with the session's index, as this
        client tracks it; `step_index` (the session's index before this step) makes every send
        carry it, and the runtime then refuses the step with `StepConflict` when the session is
        elsewhere (see `codegym_client.resend`)."""
        with self.indexes.holding((session_id,)):
            deadline = self.indexes.deadline((session_id,), self.timeout_s)
            request, numbered = step_requests(session_id, action, step_index, self.indexes)
            try:
                response: rt.StepResponse = self._send(
                    "Step",
                    lambda first: self.stub.Step(request if first else numbered, timeout=deadline),
                    repeatable=numbered.HasField("step_index"),
                )
            except SessionNotFound:
                self.indexes.forget(session_id)
                raise
            self.indexes.learn(session_id, response)
            return response

    @raises_typed("BatchStep")
    def batch_step(self, steps: Sequence[tuple[str, ActionLike]]) -> list[rt.BatchStepResult]:
        """One step for each of several distinct sessions, in one call; each entry is answered
        with a response or a status (`code`, `message`, e.g. NOT_FOUND for an unknown session).

        An entry the runtime answers UNAVAILABLE applied nothing: it is sent again (with its
        session's index) in a smaller batch, while the budget lasts. The whole call is sent again
        when its reply is lost and this client knows every entry's session index; otherwise it
        raises, as a lost Step of an unknown session does. Entries still failing when the budget
        runs out are returned with their last code."""
        ids = [session_id for session_id, _ in steps]
        with self.indexes.holding(ids):
            deadline = self.indexes.deadline(ids, self.timeout_s)
            batch = PendingBatch(steps, self.indexes, self.attempts)
            while True:
                try:
                    answer = self.stub.BatchStep(batch.request(), timeout=deadline)
                except grpc.RpcError as exc:
                    delay = batch.after_error(exc, self._closed)
                else:
                    delay = batch.after_answer(answer, self._closed)
                if delay is None:
                    return batch.finish(self.indexes)
                time.sleep(delay)

    @raises_typed("Reset")
    def reset(self, session_id: str) -> str:
        """Reset to the session's own task (sent again when its reply is lost: a reset twice is one)."""
        with self.indexes.holding((session_id,)):
            request = rt.ResetRequest(session_id=session_id)
            response = self._send(
                "Reset", lambda _: self.stub.Reset(request, timeout=self.timeout_s), repeatable=True
            )
            self.indexes.set(session_id, 0)
            return str(response.observation)

    @raises_typed("CloseSession")
    def close_session(self, session_id: str) -> bool:
        response = self.stub.CloseSession(
            rt.CloseSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        self.indexes.forget(session_id)
        return bool(response.existed)

    @raises_typed("GetSession")
    def get_session(self, session_id: str) -> rt.GetSessionResponse:
        response: rt.GetSessionResponse = self.stub.GetSession(
            rt.GetSessionRequest(session_id=session_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("ListEnvs")
    def list_envs(self, prefix: str = "", page_size: int = 100) -> list[rt.EnvSummary]:
        """Every environment whose id starts with `prefix`, read a page at a time (as the async
        client's: a list, so a failed page raises here, not half way through the caller's loop)."""
        envs: list[rt.EnvSummary] = []
        token = ""
        while True:
            page = self.stub.ListEnvs(
                rt.ListEnvsRequest(prefix=prefix, page_size=page_size, page_token=token),
                timeout=self.timeout_s,
            )
            envs.extend(page.envs)
            token = page.next_page_token
            if not token:
                return envs

    @raises_typed("GetEnv")
    def get_env(self, env_id: str) -> rt.GetEnvResponse:
        response: rt.GetEnvResponse = self.stub.GetEnv(
            rt.GetEnvRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("Stats")
    def stats(
        self, run_id: str = "", *, env_prefix: str = "", envs_only: bool = False, played_only: bool = False
    ) -> Iterator[rt.StatsResponse]:
        """The runtime's record of served episodes: each task (unless `envs_only`), then each env."""
        request = rt.StatsRequest(
            run_id=run_id, env_prefix=env_prefix, envs_only=envs_only, played_only=played_only
        )
        yield from self.stub.Stats(request, timeout=max(self.timeout_s, 300.0))

    @raises_typed("SampleTasks")
    def sample_tasks(self, run_id: str, n: int, **options: Any) -> rt.SampleTasksResponse:
        """`n` task configurations chosen for the run (see `sample_request` for `options`)."""
        request = sample_request(run_id, n, **options)
        response: rt.SampleTasksResponse = self._send(
            "SampleTasks",
            lambda _: self.stub.SampleTasks(request, timeout=max(self.timeout_s, 60.0)),
            repeatable=True,
        )
        return response

    @raises_typed("LiftQuarantine")
    def lift_quarantine(self, env_id: str) -> bool:
        """Let a quarantined environment be sampled again; whether it was quarantined."""
        response = self.stub.LiftQuarantine(rt.LiftQuarantineRequest(env_id=env_id), timeout=self.timeout_s)
        return bool(response.lifted)

    @raises_typed("SearchEnvs")
    def search_envs(self, page_token: str = "", **filters: Any) -> rt.SearchEnvsResponse:
        """A page of the library's environments matching `filters` (SearchEnvsRequest's fields:
        text, source, learnability, min_pass_rate, max_pass_rate, page_size)."""
        response: rt.SearchEnvsResponse = self.stub.SearchEnvs(
            rt.SearchEnvsRequest(page_token=page_token, **filters), timeout=self.timeout_s
        )
        return response

    @raises_typed("ListEpisodes")
    def list_episodes(self, **filters: Any) -> Iterator[rt.EpisodeSummary]:
        """Every captured episode matching `filters` (ListEpisodesRequest's fields: run_id, env_id,
        rewarded, flagged_only, errors_only, page_size), newest first, a page at a time."""
        token = ""
        while True:
            page = self.stub.ListEpisodes(
                rt.ListEpisodesRequest(page_token=token, **filters), timeout=self.timeout_s
            )
            yield from page.episodes
            token = page.next_page_token
            if not token:
                return

    @raises_typed("GetEpisode")
    def get_episode(self, episode_id: str) -> rt.GetEpisodeResponse:
        """One captured episode, with its steps (`EpisodeNotFound` when none is held)."""
        response: rt.GetEpisodeResponse = self.stub.GetEpisode(
            rt.GetEpisodeRequest(episode_id=episode_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("GetEnvCode")
    def get_env_code(self, env_id: str) -> rt.GetEnvCodeResponse:
        """An environment's source (an operator's token only)."""
        response: rt.GetEnvCodeResponse = self.stub.GetEnvCode(
            rt.GetEnvCodeRequest(env_id=env_id), timeout=self.timeout_s
        )
        return response

    @raises_typed("ForkSession")
    def fork_session(
        self,
        session_id: str,
        count: int = 1,
        at_step: int | None = None,
        reseed: bool = False,
        *,
        request_id: str = "",
    ) -> list[rt.ForkedSession]:
        """`count` new sessions continuing `session_id` from its last committed step (or, with
        `at_step`, from that earlier step of a session created with `keep_history`): each a session
        of its own (`session_id`, `step_index`) whose steps replay the source's draws unless
        `reseed`. Sent again when its reply is lost: the runtime answers a resend (same request id)
        with the same forks. A caller that sends it again itself (riding out an outage past these
        resends) passes one `request_id` of its own each time. See docs/fork.md."""
        request = fork_request(session_id, count, at_step, reseed, request_id)
        response: rt.ForkSessionResponse = self._send(
            "ForkSession",
            lambda _: self.stub.ForkSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        for fork in response.sessions:
            self.indexes.made(fork)
        return list(response.sessions)

    @raises_typed("CheckpointSession")
    def checkpoint_session(self, session_id: str, close: bool = False, *, request_id: str = "") -> bytes:
        """The session as an opaque sealed blob (`restore_session` brings it back, on any replica of
        the deployment); `close` suspends it (the runtime then holds nothing of it)."""
        request = checkpoint_request(session_id, close, request_id)
        response: rt.CheckpointSessionResponse = self._send(
            "CheckpointSession",
            lambda _: self.stub.CheckpointSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        if close:
            self.indexes.forget(session_id)
        return bytes(response.checkpoint)

    @raises_typed("RestoreSession")
    def restore_session(self, blob: bytes, *, request_id: str = "") -> rt.ForkedSession:
        """A new session from a checkpoint blob (each restore of one blob is an episode of its own)."""
        request = restore_request(blob, request_id)
        response: rt.RestoreSessionResponse = self._send(
            "RestoreSession",
            lambda _: self.stub.RestoreSession(request, timeout=self.timeout_s),
            repeatable=True,
        )
        self.indexes.made(response.session)
        return response.session

    @raises_typed("RunHistory")
    def run_history(self, run_id: str = "") -> list[rt.RunHistoryPoint]:
        """The run's played tasks by pool at each policy version it reached, oldest first."""
        response = self.stub.RunHistory(rt.RunHistoryRequest(run_id=run_id), timeout=self.timeout_s)
        return list(response.points)
