"""The LLM gateway: every model call of the synthesis service goes through here.

One `openai.AsyncOpenAI` client against any OpenAI-compatible endpoint, with what a long batch
run needs: bounded concurrency, retries with exponential back-off and jitter on 429, 5xx,
timeouts and connection errors (a `Retry-After` header wins over the back-off), a response cache
so an interrupted run resumes without paying twice, and token accounting per stage.

Several samples come from one request with `n` when the endpoint supports it; an endpoint that
refuses `n` (or returns fewer choices) gets the missing samples as parallel single requests, and
the gateway remembers not to ask it for `n` again.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

import openai

from codegym.server.metrics import LLM_CACHE_HITS, LLM_REQUESTS, LLM_RETRIES, LLM_TOKENS
from services.synthesis.llm_cache import CachedCompletion, ResponseCache, cache_key
from services.synthesis.settings import LLMSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageParams:
    """Sampling parameters of one stage; `samples` completions are wanted per prompt."""

    model: str = ""
    temperature: float = 0.7
    top_p: float = 0.95
    max_tokens: int = 8192
    samples: int = 1

    def merged(self, **overrides: Any) -> StageParams:
        return replace(self, **{k: v for k, v in overrides.items() if v})


@dataclass
class StageUsage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cache_hits: int = 0
    requests: int = 0
    retries: int = 0

    def add(self, **counts: int) -> None:
        for key, value in counts.items():
            setattr(self, key, getattr(self, key) + value)


class Tally:
    """Counts for one stage of the gateway's totals and, when given, for one caller's request.

    Concurrent calls share the gateway's per-stage totals; a caller that reports usage per request
    (the synthesis service does, in every response) passes its own `StageUsage` to be counted too.
    """

    def __init__(self, stage: str, *targets: StageUsage | None) -> None:
        self.stage = stage
        self.targets = [t for t in targets if t is not None]

    def add(self, **counts: int) -> None:
        for target in self.targets:
            target.add(**counts)
        for key, value in counts.items():
            if key == "requests":
                LLM_REQUESTS.labels(self.stage).inc(value)
            elif key == "retries":
                LLM_RETRIES.labels(self.stage).inc(value)
            elif key == "cache_hits":
                LLM_CACHE_HITS.labels(self.stage).inc(value)
            elif key.endswith("_tokens"):
                LLM_TOKENS.labels(self.stage, key.removesuffix("_tokens")).inc(value)


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    cached: bool = False


class LLMUnavailable(RuntimeError):
    """The endpoint could not answer (down, or failing past the retry budget)."""


class LLMRejected(RuntimeError):
    """The endpoint refused the request itself (a 4xx other than 429): retrying cannot help."""


class ContextLengthExceeded(LLMRejected):
    """The conversation no longer fits the model's context window (the endpoint said so with a
    400): a limit of the model, like its turn budget, not an outage. An agent that reaches it has
    ended its episode unsolved; sending the same conversation again fails the same way."""


# How OpenAI-compatible servers word a context overflow in a 400, matched in the error's own message
# (not in the request echoed beside it): OpenAI's and vLLM's "maximum context length is N tokens"
# (OpenAI also sets the code `context_length_exceeded`), SGLang's "longer than the model's context
# length", llama.cpp's "exceeds the available context size". vLLM words a prompt that leaves no room
# for `max_tokens` the same way: at an episode's first turn that is a setting to fix, not the
# model's limit, which is why the evaluation counts an overflow only after the first turn.
CONTEXT_OVERFLOW = re.compile(
    r"maximum context length is \d+|longer than the model'?s context length|exceeds? the available context size",
    re.IGNORECASE,
)


def error_message(exc: openai.APIStatusError) -> str:
    """The endpoint's own error message (`{"error": {"message"}}` or `{"message"}`)."""
    body = exc.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return str(inner["message"])
    return exc.message or ""


def context_overflow(exc: openai.BadRequestError) -> bool:
    """Whether a 400 says the request is longer than the model's context window."""
    return exc.code == "context_length_exceeded" or bool(CONTEXT_OVERFLOW.search(error_message(exc)))


@dataclass
class LLMGateway:
    settings: LLMSettings
    cache: ResponseCache | None = None
    usage: dict[str, StageUsage] = field(default_factory=lambda: defaultdict(StageUsage))

    def __post_init__(self) -> None:
        self.client = openai.AsyncOpenAI(
            base_url=self.settings.base_url,
            api_key=self.settings.api_key or "EMPTY",  # a local endpoint takes any
            timeout=self.settings.timeout_s,
            max_retries=0,  # retries are ours: counted, with Retry-After honoured
        )
        self.limit = asyncio.Semaphore(self.settings.max_concurrency)
        self.n_supported = True
        self.unreachable = ""

    async def close(self) -> None:
        await self.client.close()

    async def complete(
        self,
        stage: str,
        messages: list[dict[str, str]],
        params: StageParams,
        usage: StageUsage | None = None,
    ) -> list[Completion]:
        """`params.samples` completions of one prompt, from the cache where possible.

        `usage`, when given, receives this call's own counts (besides the gateway's totals).
        """
        model = params.model or self.settings.model
        keys = [cache_key(model, messages, params, i) for i in range(params.samples)]
        results: list[Completion | None] = [None] * params.samples
        tally = Tally(stage, self.usage[stage], usage)
        if self.cache is not None:
            for i, key in enumerate(keys):
                hit = self.cache.get(key)
                if hit is not None:
                    results[i] = Completion(hit.text, hit.finish_reason, cached=True)
                    tally.add(cache_hits=1)
        missing = [i for i, r in enumerate(results) if r is None]
        if len(missing) > 1 and self.n_supported:
            choices = await self._request(stage, model, messages, params, tally, n=len(missing))
            for i, choice in zip(missing, choices, strict=False):
                results[i] = self._store(keys[i], choice)
            missing = [i for i, r in enumerate(results) if r is None]
            if missing and choices:
                log.info(
                    "endpoint returned %d of %d choices; asking for the rest one by one",
                    len(choices),
                    len(keys),
                )
        if missing:
            singles = await asyncio.gather(
                *(self._request(stage, model, messages, params, tally, n=1) for _ in missing)
            )
            for i, choices in zip(missing, singles, strict=True):
                if choices:
                    results[i] = self._store(keys[i], choices[0])
        return [r for r in results if r is not None]

    async def chat(
        self,
        stage: str,
        messages: list[dict[str, Any]],
        params: StageParams,
        *,
        tools: list[dict[str, Any]] | None = None,
        usage: StageUsage | None = None,
    ) -> CachedCompletion:
        """One reply to a conversation (an agent's turn): never cached, since samples must differ."""
        model = params.model or self.settings.model
        tally = Tally(stage, self.usage[stage], usage)
        choices = await self._request(stage, model, messages, params, tally, n=1, tools=tools)
        if not choices:
            raise LLMRejected(f"{stage}: the endpoint returned no choice")
        return choices[0]

    def _store(self, key: str, choice: CachedCompletion) -> Completion:
        if self.cache is not None:
            self.cache.put(key, choice)
        return Completion(choice.text, choice.finish_reason)

    async def _request(
        self,
        stage: str,
        model: str,
        messages: list[dict[str, str]],
        params: StageParams,
        tally: Tally,
        *,
        n: int,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[CachedCompletion]:
        if self.unreachable:
            # Another request already found the endpoint unreachable: do not wait to learn it again.
            raise LLMUnavailable(f"{stage}: {self.unreachable}")
        delay = self.settings.backoff_s
        connect_failures = 0
        for attempt in range(self.settings.max_retries + 1):
            wait = 0.0
            try:
                async with self.limit:
                    tally.add(requests=1)
                    kwargs: dict[str, Any] = {}
                    if n > 1:
                        kwargs["n"] = n
                    if tools:
                        kwargs["tools"] = tools
                    response = await self.client.chat.completions.create(
                        model=model,
                        messages=messages,  # type: ignore[arg-type]
                        temperature=params.temperature,
                        top_p=params.top_p,
                        max_tokens=params.max_tokens,
                        **kwargs,
                    )
                if response.usage is not None:
                    tally.add(
                        prompt_tokens=response.usage.prompt_tokens,
                        completion_tokens=response.usage.completion_tokens,
                    )
                return [
                    CachedCompletion(
                        c.message.content or "",
                        c.finish_reason or "",
                        tuple(function_calls(c.message.tool_calls)),
                    )
                    for c in sorted(response.choices, key=lambda c: c.index)
                ]
            except openai.BadRequestError as exc:
                if n > 1:
                    # Most likely `n` is not supported: fall back to single requests for good.
                    log.info("endpoint refused n=%d (%s); using parallel requests", n, exc.message)
                    self.n_supported = False
                    return []
                if context_overflow(exc):
                    raise ContextLengthExceeded(
                        f"{stage}: the conversation exceeds the model's context: {exc.message}"
                    ) from exc
                raise LLMRejected(f"{stage}: the endpoint refused the request: {exc.message}") from exc
            except openai.RateLimitError as exc:
                wait = retry_after(exc.response) or delay
                cause: str = f"429 rate limited: {exc.message}"
            except openai.InternalServerError as exc:
                wait = retry_after(exc.response) or delay
                cause = f"{exc.status_code} server error: {exc.message}"
            except openai.APITimeoutError:
                wait, cause = delay, f"timed out after {self.settings.timeout_s:.0f} s"
            except openai.APIConnectionError as exc:
                wait, cause = delay, f"connection failed: {exc.__cause__ or exc}"
                if unreachable(exc):
                    # Refused or unresolvable: no back-off makes a server appear; say so in seconds.
                    connect_failures += 1
                    if connect_failures > CONNECT_RETRIES:
                        self.unreachable = (
                            f"cannot reach the LLM endpoint {self.settings.base_url}: {exc.__cause__ or exc}"
                        )
                        raise LLMUnavailable(f"{stage}: {self.unreachable}") from exc
                    wait = CONNECT_RETRY_S
            except openai.APIStatusError as exc:
                if exc.status_code >= 500:
                    wait, cause = retry_after(exc.response) or delay, f"{exc.status_code}: {exc.message}"
                else:
                    raise LLMRejected(f"{stage}: the endpoint refused the request: {exc.message}") from exc
            if attempt == self.settings.max_retries:
                raise LLMUnavailable(
                    f"{stage}: LLM endpoint unavailable after {attempt + 1} attempts: {cause}"
                )
            tally.add(retries=1)
            log.warning("%s: %s; retry %d in %.2f s", stage, cause, attempt + 1, wait)
            await asyncio.sleep(wait * (1 + 0.25 * random.random()))
            delay = min(delay * 2, self.settings.max_backoff_s)
        raise AssertionError("unreachable")


def function_calls(tool_calls: Any) -> list[dict[str, Any]]:
    """The function calls of a reply as plain dicts (other kinds of tool call are skipped)."""
    calls = []
    for call in tool_calls or []:
        function = getattr(call, "function", None)
        if function is not None:
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": function.name, "arguments": function.arguments},
                }
            )
    return calls


# A refused connection or an unknown host is retried this often, this far apart, then reported.
CONNECT_RETRIES = 2
CONNECT_RETRY_S = 0.5


def unreachable(exc: openai.APIConnectionError) -> bool:
    """The endpoint cannot be reached at all (connection refused, host unknown), as opposed to a
    connection that broke or timed out mid-request (which patient retries may outlast)."""
    # By class name: the HTTP library under `openai` varies (httpx, or a fork of it).
    names = {c.__name__ for c in type(exc.__cause__).__mro__} if exc.__cause__ is not None else set()
    return "ConnectError" in names and "TimeoutException" not in names


def retry_after(response: Any) -> float:
    """Seconds from `Retry-After` / `retry-after-ms` headers (0 when absent or unreadable)."""
    headers = getattr(response, "headers", None)
    if headers is None:
        return 0.0
    try:
        if headers.get("retry-after-ms"):
            return float(headers["retry-after-ms"]) / 1000
        if headers.get("retry-after"):
            return float(headers["retry-after"])
    except ValueError:
        return 0.0
    return 0.0
