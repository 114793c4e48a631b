"""The `codegym.verification.v1.VerificationService` servicer and its server.

A check that finds the generated code wanting answers OK with `VERDICT_FAIL` and reasons; RPC
errors are kept for requests that cannot be checked at all (INVALID_ARGUMENT) and for sandbox
workers that cannot be reached (UNAVAILABLE, so a pipeline retries later instead of recording a
rejection that was never earned).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from codegym.errors import Reason, Refusal, add_lenient, guarded
from codegym.server.auth import ServerAuth
from codegym.server.grpcutil import ManagedServer
from codegym.verification.v1 import verification_service_pb2 as vf
from codegym.verification.v1 import verification_service_pb2_grpc as vf_grpc
from services.dispatcher import SandboxDispatcher, SandboxUnavailable
from services.verification.checks import Verifier
from services.verification.settings import VerificationSettings

log = logging.getLogger(__name__)
SERVICE_NAME = vf.DESCRIPTOR.services_by_name["VerificationService"].full_name
# Largest matrix one CheckSolvability call may ask for (candidates × tests).
MAX_CASES = 20_000
Response = TypeVar("Response")


class VerificationServicer(vf_grpc.VerificationServiceServicer):
    def __init__(self, verifier: Verifier) -> None:
        self.verifier = verifier

    async def _checked(
        self, context: grpc.aio.ServicerContext, source: str, check: Callable[[], Awaitable[Response]]
    ) -> Response:
        if not source.strip():
            raise Refusal(Reason.INVALID_REQUEST, "env_source is empty")
        try:
            return await check()
        except SandboxUnavailable as exc:
            raise Refusal(Reason.UNAVAILABLE, str(exc)) from None
        except grpc.aio.AioRpcError as exc:
            # A worker that never answered (no worker reachable before the deadline) or refused
            # the batch: the check did not happen, which the caller must not take for a verdict.
            raise Refusal(
                Reason.UNAVAILABLE, f"sandbox workers failed the request: {exc.code().name}: {exc.details()}"
            ) from None

    @guarded
    async def CheckEnvironment(
        self, request: vf.CheckEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> vf.CheckEnvironmentResponse:
        return await self._checked(
            context, request.env_source, lambda: self.verifier.check_environment(request)
        )

    @guarded
    async def ValidateUnitTests(
        self, request: vf.ValidateUnitTestsRequest, context: grpc.aio.ServicerContext
    ) -> vf.ValidateUnitTestsResponse:
        ratio = request.thresholds.min_valid_ratio
        if not 0 <= ratio <= 1:
            raise Refusal(Reason.INVALID_REQUEST, f"min_valid_ratio {ratio} is not in [0, 1]")
        return await self._checked(
            context, request.env_source, lambda: self.verifier.validate_unit_tests(request)
        )

    @guarded
    async def CheckSolvability(
        self, request: vf.CheckSolvabilityRequest, context: grpc.aio.ServicerContext
    ) -> vf.CheckSolvabilityResponse:
        cases = len(request.tasks) * len(request.solve_sources)
        if cases > MAX_CASES:
            raise Refusal(
                Reason.INVALID_REQUEST,
                f"{len(request.solve_sources)} candidates × {len(request.tasks)} tests is more than"
                f" {MAX_CASES} runs: split the request",
            )
        return await self._checked(
            context, request.env_source, lambda: self.verifier.check_solvability(request)
        )

    @guarded
    async def CheckShortcuts(
        self, request: vf.CheckShortcutsRequest, context: grpc.aio.ServicerContext
    ) -> vf.CheckShortcutsResponse:
        if not 0 <= request.max_fraction <= 1:
            raise Refusal(Reason.INVALID_REQUEST, f"max_fraction {request.max_fraction} is not in [0, 1]")
        return await self._checked(
            context, request.env_source, lambda: self.verifier.check_shortcuts(request)
        )

    @guarded
    async def CheckNegativeControls(
        self, request: vf.CheckNegativeControlsRequest, context: grpc.aio.ServicerContext
    ) -> vf.CheckNegativeControlsResponse:
        return await self._checked(
            context, request.env_source, lambda: self.verifier.check_negative_controls(request)
        )

    @guarded
    async def CheckDeterminism(
        self, request: vf.CheckDeterminismRequest, context: grpc.aio.ServicerContext
    ) -> vf.CheckDeterminismResponse:
        return await self._checked(
            context, request.env_source, lambda: self.verifier.check_determinism(request)
        )

    @guarded
    async def MeasureGuessability(
        self, request: vf.MeasureGuessabilityRequest, context: grpc.aio.ServicerContext
    ) -> vf.MeasureGuessabilityResponse:
        if not 0 <= request.max_guess_rate <= 1:
            raise Refusal(Reason.INVALID_REQUEST, f"max_guess_rate {request.max_guess_rate} is not in [0, 1]")
        return await self.verifier.measure_guessability(request)


class VerificationServer:
    """Build inside the running loop."""

    def __init__(self, settings: VerificationSettings, *, auth: ServerAuth | None = None) -> None:
        """`auth`: what `settings.access` loads to, when the caller holds it already (in memory)."""
        auth = ServerAuth.load(settings.access) if auth is None else auth
        self.dispatcher = SandboxDispatcher(settings.sandbox, access=settings.calls.access())
        self.servicer = VerificationServicer(Verifier(self.dispatcher))
        self.managed = ManagedServer([SERVICE_NAME], host=settings.host, port=settings.port, auth=auth)
        add_lenient(
            self.servicer, self.managed.server, vf.DESCRIPTOR.services_by_name["VerificationService"], vf
        )

    @property
    def address(self) -> str:
        return self.managed.address

    async def start(self) -> None:
        await self.managed.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.managed.drain(grace_s)
        await self.dispatcher.close()

    def banner(self) -> str:
        return f"verification listening on {self.address}"
