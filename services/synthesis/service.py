"""The `codegym.synthesis.v1.SynthesisService` servicer and its server.

LLM failures are typed: an endpoint that is down (or failing past the retry budget) answers
UNAVAILABLE with the cause; an endpoint that refuses the request answers FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from codegym.errors import Reason, Refusal, add_lenient, guarded, guarded_stream
from codegym.server.auth import ServerAuth
from codegym.server.grpcutil import ManagedServer
from codegym.synthesis.v1 import synthesis_service_pb2 as sy
from codegym.synthesis.v1 import synthesis_service_pb2_grpc as sy_grpc
from services.synthesis.llm import (
    LLMGateway,
    LLMRejected,
    LLMUnavailable,
    StageParams,
    StageUsage,
)
from services.synthesis.llm_cache import ResponseCache
from services.synthesis.pipeline import synthesize_all
from services.synthesis.problems import Problem
from services.synthesis.settings import SynthesisSettings
from services.synthesis.stages import StageDefaults, Synthesizer

log = logging.getLogger(__name__)
SERVICE_NAME = sy.DESCRIPTOR.services_by_name["SynthesisService"].full_name
STATUS = {
    "ok": sy.PARSE_STATUS_OK,
    "missing_marker": sy.PARSE_STATUS_MISSING_MARKER,
    "syntax_error": sy.PARSE_STATUS_SYNTAX_ERROR,
    "contract_violation": sy.PARSE_STATUS_CONTRACT_VIOLATION,
    "invalid_test": sy.PARSE_STATUS_INVALID_TEST,
    "truncated": sy.PARSE_STATUS_TRUNCATED,
}
T = TypeVar("T")


def params_from(message: sy.StageParams) -> StageParams | None:
    if not message.ByteSize():
        return None
    return StageParams(
        model=message.model,
        temperature=message.temperature,
        top_p=message.top_p,
        max_tokens=message.max_tokens,
        samples=message.samples,
    )


def problem_from(message: sy.Problem) -> Problem:
    return Problem(message.question_id, message.question, message.solution, message.tests)


class SynthesisServicer(sy_grpc.SynthesisServiceServicer):
    def __init__(self, gateway: LLMGateway, out_dir: Path, defaults: StageDefaults | None = None) -> None:
        self.gateway = gateway
        self.synth = Synthesizer(gateway, defaults)
        self.out_dir = out_dir

    @staticmethod
    def _usage(usage: StageUsage) -> sy.TokenUsage:
        """This request's own counts (concurrent requests of the same stage are not mixed in)."""
        return sy.TokenUsage(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cache_hits=usage.cache_hits,
            requests=usage.requests,
        )

    async def _llm(self, context: grpc.aio.ServicerContext, call: Awaitable[T]) -> T:
        try:
            return await call
        except LLMUnavailable as exc:
            raise Refusal(Reason.UNAVAILABLE, str(exc)) from None
        except LLMRejected as exc:
            raise Refusal(Reason.UPSTREAM_REJECTED, str(exc)) from None

    @guarded
    async def GenerateEnvironment(
        self, request: sy.GenerateEnvironmentRequest, context: grpc.aio.ServicerContext
    ) -> sy.GenerateEnvironmentResponse:
        problem = problem_from(request.problem)
        if not problem.question.strip() or not problem.solution.strip():
            raise Refusal(Reason.INVALID_REQUEST, "problem needs question and solution")
        usage = StageUsage()
        envs = await self._llm(context, self.synth.environment(problem, params_from(request.params), usage))
        return sy.GenerateEnvironmentResponse(
            candidates=[
                sy.EnvironmentCandidate(
                    status=STATUS[e.status],
                    reasons=e.reasons,
                    task_text=e.task_text,
                    env_source=e.env_source,
                    env_class=e.env_class,
                )
                for e in envs
            ],
            usage=self._usage(usage),
        )

    @guarded
    async def GenerateUnitTests(
        self, request: sy.GenerateUnitTestsRequest, context: grpc.aio.ServicerContext
    ) -> sy.GenerateUnitTestsResponse:
        if not request.env_source.strip():
            raise Refusal(Reason.INVALID_REQUEST, "env_source is empty")
        usage = StageUsage()
        tests = await self._llm(
            context,
            self.synth.unit_tests(
                request.task_text,
                request.env_source,
                hard=request.hard,
                seed_tests=list(request.seed_tests),
                params=params_from(request.params),
                usage=usage,
            ),
        )
        return sy.GenerateUnitTestsResponse(
            tests=[
                sy.UnitTestCandidate(
                    status=STATUS[t.status],
                    reason=t.reason,
                    env_str=t.env_str,
                    config_json=t.config_json,
                    difficulty=t.difficulty,
                )
                for t in tests
            ],
            usage=self._usage(usage),
        )

    @guarded
    async def GenerateSolveFunctions(
        self, request: sy.GenerateSolveFunctionsRequest, context: grpc.aio.ServicerContext
    ) -> sy.GenerateSolveFunctionsResponse:
        if not request.env_source.strip():
            raise Refusal(Reason.INVALID_REQUEST, "env_source is empty")
        usage = StageUsage()
        solves = await self._llm(
            context,
            self.synth.solve_functions(
                request.task_text,
                request.env_source,
                count=request.count,
                params=params_from(request.params),
                usage=usage,
            ),
        )
        return sy.GenerateSolveFunctionsResponse(
            candidates=[
                sy.SolveCandidate(
                    status=STATUS[s.status],
                    reasons=s.reasons,
                    solve_source=s.solve_source,
                    env_source=s.env_source,
                )
                for s in solves
            ],
            usage=self._usage(usage),
        )

    @guarded_stream
    async def SynthesizeStream(
        self, request: sy.SynthesizeStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[sy.SynthesizeStreamResponse]:
        problems = [problem_from(p) for p in request.problems]
        ids = [p.question_id for p in problems]
        if not problems or len(set(ids)) != len(ids) or not all(ids):
            raise Refusal(Reason.INVALID_REQUEST, "give problems with distinct, non-empty question_ids")
        out = self.out_dir / time.strftime("run-%Y%m%d-%H%M%S")
        queue: asyncio.Queue[sy.SynthesizeStreamResponse | None] = asyncio.Queue()
        finished: set[str] = set()

        def progress(qid: str, stage: str, ok: int, bad: int, reasons: list[str]) -> None:
            if stage in ("solve_functions", "error") or (stage == "environment" and ok == 0):
                finished.add(qid)
            queue.put_nowait(
                sy.SynthesizeStreamResponse(
                    question_id=qid,
                    stage=stage,
                    accepted=ok,
                    rejected=bad,
                    reasons=reasons[:20],
                    done=len(finished),
                    total=len(problems),
                    output=str(out),
                )
            )

        async def run() -> dict[str, Any]:
            try:
                return await synthesize_all(self.synth, problems, out, progress)
            finally:
                queue.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            while (item := await queue.get()) is not None:
                yield item
            report = await task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if report["errors"] and len(report["errors"]) == len(problems):
            raise Refusal(Reason.UNAVAILABLE, next(iter(report["errors"].values())))
        yield sy.SynthesizeStreamResponse(
            stage="summary",
            accepted=report["environments"],
            rejected=len(problems) - report["environments"],
            done=len(problems),
            total=len(problems),
            output=str(out),
        )


class SynthesisServer:
    """Build inside the running loop."""

    def __init__(self, settings: SynthesisSettings, *, auth: ServerAuth | None = None) -> None:
        """`auth`: what `settings.access` loads to, when the caller holds it already (in memory).
        A bad `--stage` override is a ValueError."""
        auth = ServerAuth.load(settings.access) if auth is None else auth
        out_dir = Path(settings.out)
        self.cache = ResponseCache(Path(settings.cache) if settings.cache else out_dir / "llm_cache.db")
        self.gateway = LLMGateway(settings.llm, self.cache)
        defaults = StageDefaults.overridden(settings.stages.overrides)
        self.servicer = SynthesisServicer(self.gateway, out_dir, defaults)
        self.managed = ManagedServer([SERVICE_NAME], host=settings.host, port=settings.port, auth=auth)
        add_lenient(
            self.servicer, self.managed.server, sy.DESCRIPTOR.services_by_name["SynthesisService"], sy
        )

    @property
    def address(self) -> str:
        return self.managed.address

    async def start(self) -> None:
        await self.managed.start()

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.managed.drain(grace_s)
        await self.gateway.close()
        self.cache.close()

    def banner(self) -> str:
        return f"synthesis listening on {self.address} (LLM {self.gateway.settings.base_url})"
