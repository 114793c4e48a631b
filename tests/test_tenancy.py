"""Quotas between tenants (issue #31, part 2): a token's tenant, its limits, its sessions.

A real runtime with a tokens file naming two trainer tenants, one with tight limits, over a real
sandbox worker; clients on each tenant's token. Past its quota a tenant gets CAPACITY with a
retry-after and nothing else changes; the other tenant is not touched; a session id of another
tenant is unknown to it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from codegym.errors import Refusal
from codegym.library.store import Library
from codegym.server.auth import TenantLimits
from codegym_client import RuntimeClient
from codegym_client.api.runtime.v1 import runtime_service_pb2 as rt
from codegym_client.api.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from codegym_client.channels import TLS_CA_ENV, TOKEN_ENV
from codegym_client.errors import CapacityExceeded, SessionNotFound
from services.runtime.tenancy import Bucket as TokenBucket
from services.runtime.tenancy import Quotas
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.servers import CodegymServer, Redis

pytestmark = pytest.mark.jail  # the runtime steps on a real sandbox worker

ABILITY = 'codegym_v1@Sample_0001_I__MaxSubarraySumEnv@{"nums": [1]}'
OBSERVE = '{"name": "Observe", "parameters": {}}'
TOKENS = {
    "tokens": {
        "tight-token": {"tenant": "tight", "role": "trainer"},
        "roomy-token": {"tenant": "roomy", "role": "trainer"},
        "ops-token": {"tenant": "ops", "role": "operator"},
        "service-token": {"tenant": "services", "role": "service"},
    },
    "tenants": {"tight": {"sessions": 2, "steps_per_s": 4, "creates_per_s": 50}},
}


def test_a_bucket_passes_a_second_of_its_rate_then_holds_to_it() -> None:
    bucket = TokenBucket(4.0, stamp=0.0)
    assert [bucket.take(now=0.0) for _ in range(4)] == [0.0] * 4
    assert bucket.take(now=0.0) == pytest.approx(0.25)
    assert bucket.take(now=0.25) == 0.0  # a quarter second later, one more


def test_calls_refused_together_are_told_to_come_back_one_tokens_time_apart() -> None:
    """Twenty callers refused at once come back spread out, so each finds its token instead of
    nineteen being refused again every token's time."""
    bucket = TokenBucket(50.0, stamp=0.0)
    for _ in range(50):
        assert bucket.take(now=0.0) == 0.0
    waits = [bucket.take(now=0.0) for _ in range(20)]
    assert waits == pytest.approx([(i + 1) / 50 for i in range(20)])
    # Each comes back at its time and is served: none refused again.
    assert all(bucket.take(now=w) == 0.0 for w in waits)


def test_quotas_refuse_with_capacity_and_a_retry_after_and_leave_others_alone() -> None:
    quotas = Quotas({"tight": TenantLimits(sessions=1, steps_per_s=2)})
    quotas.admit_step("tight")
    quotas.admit_step("tight")
    with pytest.raises(Refusal) as refused:
        quotas.admit_step("tight")
    assert refused.value.reason.name == "CAPACITY" and 0 < refused.value.retry_after_ms <= 500
    for _ in range(100):
        quotas.admit_step("roomy")  # no limits named: none
    with pytest.raises(Refusal, match="holds 1 sessions"):
        quotas.admit_create("tight", 1, 1000)
    quotas.admit_create("tight", 0, 1000)


ENV = {k: v for k, v in os.environ.items() if k not in (TOKEN_ENV, TLS_CA_ENV)}


def stack(folder: Path, *runtime_args: str) -> tuple[CodegymServer, CodegymServer]:
    """A worker and a runtime taking the tokens file; the runtime steps on its service token."""
    (folder / "tokens.json").write_text(json.dumps(TOKENS))
    with Library(folder / "library.db") as lib:
        lib.import_paths([ENV_DIR, SAMPLES / "tasks.jsonl"])
    worker = CodegymServer(
        ["serve", "sandbox", "--port", "0", "--jails", "1", "--tokens", str(folder / "tokens.json")], env=ENV
    )
    return worker, runtime_on(folder, worker, *runtime_args)


def runtime_on(folder: Path, worker: CodegymServer, *extra: str) -> CodegymServer:
    args = ["serve", "runtime", "--port", "0", "--library", str(folder / "library.db")]
    args += ["--sandbox", worker.address, "--tokens", str(folder / "tokens.json"), "--no-record", *extra]
    return CodegymServer(args, env={**ENV, TOKEN_ENV: "service-token"})


@pytest.fixture(scope="module")
def runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CodegymServer]:
    worker, runtime = stack(tmp_path_factory.mktemp("tenancy"))
    try:
        yield runtime
    finally:
        runtime.stop()
        worker.stop()


def client_of(address: str, token: str, monkeypatch: pytest.MonkeyPatch, attempts: int = 1) -> RuntimeClient:
    monkeypatch.setenv(TOKEN_ENV, token)
    return RuntimeClient(address, attempts=attempts)


def step_honouring_capacity(client: RuntimeClient, session_id: str) -> rt.StepResponse:
    """A step, sent again after each CAPACITY's retry-after, as a trainer's adapter does (the step
    quota may still be spent by the test before)."""
    for _ in range(50):
        try:
            return client.step(session_id, OBSERVE)
        except CapacityExceeded as exc:
            time.sleep(exc.retry_after_s or 0.1)
    raise AssertionError("the step quota never let a step through")


def raw_stub(address: str, token: str) -> tuple[grpc.Channel, rt_grpc.RuntimeServiceStub]:
    channel = grpc.secure_channel(
        address,
        grpc.composite_channel_credentials(
            grpc.local_channel_credentials(), grpc.access_token_call_credentials(token)
        ),
    )
    return channel, rt_grpc.RuntimeServiceStub(channel)


def test_a_tenant_past_its_sessions_gets_capacity_and_the_other_is_untouched(
    runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = client_of(runtime.address, "tight-token", monkeypatch)
    roomy = client_of(runtime.address, "roomy-token", monkeypatch)
    held = [tight.create_session(ability=ABILITY).session_id for _ in range(2)]
    channel, stub = raw_stub(runtime.address, "tight-token")
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreateSession(rt.CreateSessionRequest(ability=ABILITY), timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'tight' holds 2 sessions (its quota is 2)" in str(refused.value.details())
    assert any(k == "retry-after-ms" for k, _ in refused.value.trailing_metadata() or ())
    channel.close()
    roomy_ids = [roomy.create_session(ability=ABILITY).session_id for _ in range(5)]  # not limited
    # Closing one frees its place: the quota counts the sessions held, nothing else.
    assert tight.close_session(held[0]) is True
    held[0] = tight.create_session(ability=ABILITY).session_id
    for session_id in held:
        tight.close_session(session_id)
    for session_id in roomy_ids:
        roomy.close_session(session_id)
    tight.close()
    roomy.close()


def test_a_tenant_past_its_step_rate_is_refused_and_the_other_is_served(
    runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = client_of(runtime.address, "tight-token", monkeypatch)
    roomy = client_of(runtime.address, "roomy-token", monkeypatch)
    mine = tight.create_session(ability=ABILITY).session_id
    theirs = roomy.create_session(ability=ABILITY, max_steps=64).session_id
    channel, stub = raw_stub(runtime.address, "tight-token")
    codes = []
    for _ in range(12):  # back to back: far past 4 a second
        try:
            stub.Step(rt.StepRequest(session_id=mine, action_json=OBSERVE), timeout=10)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    channel.close()
    assert codes[:4] == ["OK"] * 4 and "RESOURCE_EXHAUSTED" in codes
    served = [roomy.step(theirs, OBSERVE) for _ in range(12)]
    assert [r.step_index for r in served] == list(range(1, 13))
    # The refused steps changed nothing: the session is where its served steps left it.
    assert tight.get_session(mine).step_index == codes.count("OK")
    tight.close_session(mine)
    roomy.close_session(theirs)
    tight.close()
    roomy.close()


def test_another_tenants_session_is_unknown_and_untouched(
    runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    tight = client_of(runtime.address, "tight-token", monkeypatch)
    roomy = client_of(runtime.address, "roomy-token", monkeypatch)
    ops = client_of(runtime.address, "ops-token", monkeypatch)
    mine = tight.create_session(ability=ABILITY).session_id
    step_honouring_capacity(tight, mine)
    with pytest.raises(SessionNotFound):
        roomy.step(mine, OBSERVE)
    with pytest.raises(SessionNotFound):
        roomy.get_session(mine)
    with pytest.raises(SessionNotFound):
        roomy.reset(mine)
    assert roomy.close_session(mine) is False
    assert tight.get_session(mine).step_index == 1  # nothing the other tenant sent applied
    assert ops.get_session(mine).step_index == 1  # an operator sees every tenant's
    assert tight.close_session(mine) is True
    for client in (tight, roomy, ops):
        client.close()


def test_a_front_end_plays_as_the_tenant_it_names_and_a_trainer_cannot_name_one(
    runtime: CodegymServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The OpenEnv gateway calls on its service token and names its caller's tenant: the call is
    that tenant's (its quota, its sessions). A trainer naming another tenant stays itself."""
    tight = client_of(runtime.address, "tight-token", monkeypatch)
    roomy = client_of(runtime.address, "roomy-token", monkeypatch)
    as_tight = (("codegym-tenant", "tight"),)
    channel, stub = raw_stub(runtime.address, "service-token")
    made = [
        stub.CreateSession(rt.CreateSessionRequest(ability=ABILITY), metadata=as_tight, timeout=10).session_id
        for _ in range(2)
    ]
    # tight's quota of 2 sessions holds what the front end opened for it...
    with pytest.raises(grpc.RpcError) as refused:
        stub.CreateSession(rt.CreateSessionRequest(ability=ABILITY), metadata=as_tight, timeout=10)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'tight'" in str(refused.value.details())
    # ...and those sessions are tight's own, unknown to roomy.
    assert tight.get_session(made[0]).step_index == 0
    with pytest.raises(SessionNotFound):
        roomy.get_session(made[0])
    # A trainer's token naming another tenant is still its own tenant's.
    trainer_channel, trainer_stub = raw_stub(runtime.address, "roomy-token")
    theirs = trainer_stub.CreateSession(
        rt.CreateSessionRequest(ability=ABILITY), metadata=as_tight, timeout=10
    ).session_id
    trainer_channel.close()
    assert roomy.get_session(theirs).step_index == 0
    with pytest.raises(SessionNotFound):
        tight.get_session(theirs)
    # Without a name, the service's own calls are its own tenant's, not tight's.
    own = stub.CreateSession(rt.CreateSessionRequest(ability=ABILITY), timeout=10).session_id
    with pytest.raises(SessionNotFound):
        tight.get_session(own)
    stub.CloseSession(rt.CloseSessionRequest(session_id=own), timeout=10)
    channel.close()
    for session_id in made:
        assert tight.close_session(session_id) is True
    assert roomy.close_session(theirs) is True
    tight.close()
    roomy.close()


def test_in_redis_the_quota_counts_the_tenants_sessions_across_replicas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    redis = Redis()
    worker, first = stack(tmp_path, "--sessions", redis.url)
    second = runtime_on(tmp_path, worker, "--sessions", redis.url)
    try:
        a = client_of(first.address, "tight-token", monkeypatch)
        b = client_of(second.address, "tight-token", monkeypatch)
        held = [a.create_session(ability=ABILITY).session_id, b.create_session(ability=ABILITY).session_id]
        with pytest.raises(CapacityExceeded, match="holds 2 sessions"):
            a.create_session(ability=ABILITY)
        roomy = client_of(second.address, "roomy-token", monkeypatch)
        with pytest.raises(SessionNotFound):
            roomy.get_session(held[0])  # the tenant travels with the session in Redis
        assert b.close_session(held[0]) is True  # any replica, the same tenant
        held[0] = a.create_session(ability=ABILITY).session_id
        for client in (a, b, roomy):
            client.close()
    finally:
        second.stop()
        first.stop()
        worker.stop()
        redis.stop()
