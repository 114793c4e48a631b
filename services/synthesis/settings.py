"""The synthesis server's settings (`SynthesisSettings`) and the LLM endpoint's (`LLMSettings`, which
`codegym synthesize`, `pipeline run` and `eval` take too), each option declared once.

Standard library only, for `codegym --help` (the LLM client itself loads `openai`)."""

from __future__ import annotations

from dataclasses import dataclass

from codegym.server.settings import GrpcAccess, Output, host, log_level, nested, option, port

SYNTHESIS_PORT = 50071
API_KEY_ENV = "OPENAI_API_KEY"


@dataclass(frozen=True)
class LLMSettings:
    """An OpenAI-compatible endpoint and how it is called. The API key is a secret: a child process
    gets it in its environment (`OPENAI_API_KEY`), never on its command line."""

    base_url: str = option(
        "https://api.openai.com/v1",
        "--llm-base-url",
        "OpenAI-compatible endpoint (OpenAI, vLLM, SGLang, Ollama, ...)",
        env="OPENAI_BASE_URL",
    )
    api_key: str = option("", "--llm-api-key", "API key", env=API_KEY_ENV, secret=True)
    model: str = option("gpt-4o-mini", "--model", "model for every stage (see --stage)")
    timeout_s: float = option(300.0, "--timeout-s", "deadline of one LLM request")
    max_concurrency: int = option(16, "--concurrency", "LLM requests in flight")
    max_retries: int = option(6, "--max-retries", "retries on 429, 5xx, timeouts")
    backoff_s: float = option(1.0, "--backoff-s", "first retry delay (doubles)")
    max_backoff_s: float = 60.0

    def missing_key(self) -> str:
        """Why a run cannot start ("" when it can): a remote endpoint without an API key."""
        from urllib.parse import urlparse

        from codegym_client.channels import is_loopback

        host = urlparse(self.base_url).hostname or ""
        if self.api_key or is_loopback(host):
            return ""
        return f"{self.base_url} needs an API key: set {API_KEY_ENV} or pass --llm-api-key"


@dataclass(frozen=True)
class Stages:
    """Per-stage overrides of the synthesis defaults (`STAGE.KEY=VALUE`, read by
    `services.synthesis.stages.StageDefaults.overridden`)."""

    overrides: tuple[str, ...] = option(
        (),
        "--stage",
        "per-stage override, e.g. solve_functions.samples=10 or environment.model=gpt-4o (stages: "
        "environment, unit_tests, hard_tests, solve_functions; keys: model, temperature, max_tokens, samples, ...)",
        metavar="STAGE.KEY=VALUE",
    )


@dataclass(frozen=True)
class SynthesisSettings:
    """Everything `codegym serve synthesis` is told; `SynthesisServer` takes it."""

    host: str = host()
    port: int = port(SYNTHESIS_PORT)
    out: str = option("synthesis-out", "--out", "folder for SynthesizeStream runs and the cache")
    cache: str = option("", "--cache", "response cache (default OUT/llm_cache.db)")
    llm: LLMSettings = nested(LLMSettings)
    stages: Stages = nested(Stages)
    log_level: str = log_level()
    output: Output = nested(Output)
    access: GrpcAccess = nested(GrpcAccess)
