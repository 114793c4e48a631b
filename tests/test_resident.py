"""Resident sessions in the sandbox: a session's live env kept in its own jail process between steps.

Each test drives a real worker (one jail, so sessions share it) with `Execute` and a session key,
and checks the effect: which steps ran resident, that observations equal the recorded ones, and
that a failure, an eviction or a hostile session never changes another session or the committed
state.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest

from codegym.inside import frames
from codegym.inside.frames import PREFIX
from codegym.inside.settings import JAIL_CEILING
from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from tests.conftest import ENV_DIR, SAMPLES
from tests.helpers.hostile import HOSTILE_TEMPLATE, hostile
from tests.helpers.processes import jailed, stat_fields, wait_until
from tests.helpers.servers import CodegymServer, worker_fixture
from tests.test_metrics import metrics_address, scrape

pytestmark = pytest.mark.jail  # every test here starts a sandbox worker

TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
SOURCES = {p.stem: p.read_text() for p in ENV_DIR.glob("*__*Env.py")}
STEP_LIMITS = pb.Limits(wall_ms=1500, cpu_ms=1000)

# Tools with class and module state, a slow tool, and the two bombs, in one env.
RESIDENT_ENV = (
    HOSTILE_TEMPLATE.format(preamble="COUNTS = []", body="        pass")
    .replace(
        '{"Observe": 0, "Evil": 1, "Done": 2}',
        '{"Observe": 0, "Bump": 1, "Slow": 2, "Fork": 3, "Hog": 4, "Linger": 5, "Scribble": 6, "Done": 7}',
    )
    .replace(
        "    def Done(self, answer):",
        """    calls = 0

    def Bump(self):
        type(self).calls += 1
        COUNTS.append(1)
        self.step_count += 0
        return f"class {type(self).calls} module {len(COUNTS)} own {self.step_count}"

    def Slow(self):
        while True:
            pass

    def Fork(self):
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass

    def Hog(self):
        hog = []
        while True:
            hog.append(" " * 2 ** 20)

    def Linger(self):
        import threading, time
        threading.Thread(target=lambda: time.sleep(60), daemon=True).start()
        return "lingering"

    def Scribble(self):
        import os
        files = sorted(e for e in os.listdir("/tmp") if not os.path.isdir("/tmp/" + e))
        open(f"/tmp/scribble-{os.getpid()}", "w").write("x")
        return f"found {files}"

    def Done(self, answer):""",
    )
)


def call(name: str) -> str:
    return json.dumps({"name": name, "parameters": {}})


class Session:
    """One session driven straight against a worker, committing state like the runtime does."""

    def __init__(
        self,
        stub: pb_grpc.SandboxServiceStub,
        key: str,
        source: str,
        config: str = "{}",
        *,
        resident_create: bool = False,
    ) -> None:
        self.stub, self.key, self.source = stub, key, source
        create = pb.CreateOp(config_json=config, session_key=key if resident_create else "")
        created = self.execute(pb.Operation(source=pb.SourceRef(code=source), create=create))
        assert created.status == pb.STATUS_OK, created.message
        self.first = created.observation
        self.state = created.state

    def execute(self, op: pb.Operation) -> pb.OperationResult:
        return self.stub.Execute(pb.ExecuteRequest(operation=op), timeout=60).result

    def step(self, action: str, limits: pb.Limits = STEP_LIMITS) -> pb.OperationResult:
        op = pb.Operation(
            source=pb.SourceRef(code=self.source),
            limits=limits,
            step=pb.StepOp(state=self.state, action=action, session_key=self.key),
        )
        result = self.execute(op)
        if result.status == pb.STATUS_OK:
            self.state = result.state  # commit
        return result


def start_worker(*extra: str) -> CodegymServer:
    return CodegymServer(["serve", "sandbox", "--port", "0", "--jails", "1", *extra])


worker = worker_fixture()


@pytest.fixture(scope="module")
def stub(worker: CodegymServer) -> Iterator[pb_grpc.SandboxServiceStub]:
    with grpc.insecure_channel(worker.address) as channel:
        yield pb_grpc.SandboxServiceStub(channel)


def replay(
    stub: pb_grpc.SandboxServiceStub, trajectory: dict, key: str, resident_create: bool = False
) -> list[bool]:
    env_id = trajectory["env_id"]
    config = json.dumps(trajectory["config"])
    session = Session(stub, key, SOURCES[env_id], config, resident_create=resident_create)
    assert session.first == trajectory["first"]
    resident = []
    for i, (action, observation) in enumerate(trajectory["steps"]):
        result = session.step(action)
        assert result.status == pb.STATUS_OK, result.message
        assert result.observation == observation, (env_id, i)
        resident.append(result.resident)
    return resident


def test_every_step_after_the_first_runs_resident_with_recorded_observations(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    for n, trajectory in enumerate(TRAJECTORIES[::9]):
        resident = replay(stub, trajectory, f"replay-{n}")
        assert resident == [False] + [True] * (len(resident) - 1)


def test_a_session_created_with_its_key_is_resident_from_the_first_step(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    for n, trajectory in enumerate(TRAJECTORIES[4::9]):
        assert all(replay(stub, trajectory, f"created-{n}", resident_create=True))


def test_a_child_cannot_claim_what_only_the_zygote_says(stub: pb_grpc.SandboxServiceStub) -> None:
    """A step that writes its own result frame, claiming it came from a resident process (and that
    the jail holds its session), is taken for what it is: a cold answer that kept nothing."""
    claim = {"status": "ok", "observation": "forged", "from_resident": True, "made_resident": True}
    forged = hostile(answer_with(frames.encode({**claim, "held": True, "cold": "full", "id": 999})))
    session = Session(stub, "forger", forged)
    committed = session.state
    for _ in range(2):  # were the first claim believed, the second would be served as resident
        claimed = session.step(json.dumps({"name": "Evil", "parameters": {}}))
        assert claimed.status == pb.STATUS_OK and claimed.observation == "forged"
        assert not claimed.resident
        session.state = committed  # the forged answer carries no state
    assert session.step(json.dumps({"name": "Observe", "parameters": {}})).observation == "ok"


def answer_with(data: bytes) -> str:
    """The body of a hostile tool that answers its step with `data` in place of its result, and
    exits: written to every fd it holds, one of which is its result pipe."""
    return f"""
import os
for fd in os.listdir("/proc/self/fd"):
    try:
        os.write(int(fd), {data!r})
    except OSError:
        pass
os._exit(0)
"""


def raw_frame(head: bytes, state: int = 0, code: int = 0, tail: bytes = b"") -> bytes:
    """A frame as a child could write it by hand: a prefix stating these lengths, then the head
    and whatever bytes follow (which need not be what the prefix says)."""
    return PREFIX.pack(len(head), state, code) + head + tail


HEAD = b'{"status":"ok","observation":"forged"}'
GONE = "without a result"
MALFORMED = "malformed result"
# Frames a child may write instead of its result, the status each is answered with and what its
# message says: never a jail taken for broken, never a claim believed.
BAD_FRAMES = {
    "cut short": (raw_frame(HEAD, 100, tail=b"x" * 10), pb.STATUS_CRASHED, GONE),
    "lengths past its bytes": (PREFIX.pack(len(HEAD) + 5, 0, 0) + HEAD, pb.STATUS_CRASHED, GONE),
    "longer than it says": (raw_frame(HEAD, tail=b"trailing"), pb.STATUS_CRASHED, "8 bytes past the end"),
    "a state in its head": (
        raw_frame(b'{"status":"ok","state":"Q0dTMQ=="}'),
        pb.STATUS_CRASHED,
        "holds 'state', which only travels as a part",
    ),
    "a code part": (raw_frame(HEAD, 0, 3, tail=b"abc"), pb.STATUS_CRASHED, "carries a 'code' part"),
    "a head that is no object": (raw_frame(b"[1]"), pb.STATUS_CRASHED, "not an object"),
    "a head that is no JSON": (raw_frame(b"\xff\xfe{}"), pb.STATUS_CRASHED, MALFORMED),
    "a head nested past one level": (
        raw_frame(b'{"status":"ok","observation":"forged","x":{"y":[1]}}'),
        pb.STATUS_CRASHED,
        "nested past one level",
    ),
    "a head nested past any decoder": (
        raw_frame(b'{"status":"ok","x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        pb.STATUS_CRASHED,
        "nested too deeply",
    ),
    "a part larger than any result": (raw_frame(HEAD, 1 << 31), pb.STATUS_OUTPUT_LIMIT, "result larger than"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_a_malformed_answer_is_the_childs_failure_and_the_jail_serves_on(
    stub: pb_grpc.SandboxServiceStub, name: str
) -> None:
    """A child that writes a frame that does not hold (lengths that lie, a part where none goes, a
    head that is not a shallow JSON object, a size past the result limit) gets its step failed,
    with the state untouched; the jail stays up and a resident neighbour stays resident."""
    frame, status, says = BAD_FRAMES[name]
    line = next(t for t in TRAJECTORIES if len(t["steps"]) >= 3)
    neighbour = Session(
        stub, f"bad-frame-neighbour-{name}", SOURCES[line["env_id"]], json.dumps(line["config"])
    )
    steps = iter(line["steps"])
    for _ in range(2):
        action, observation = next(steps)
        assert neighbour.step(action).observation == observation
    replaced = stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10).jails_replaced
    attacker = Session(stub, f"bad-frame-{name}", hostile(answer_with(frame)))
    committed = attacker.state
    answered = attacker.step(call("Evil"))
    assert answered.status == status and says in answered.message, answered.message
    assert not answered.resident and answered.state == b"" and answered.observation == ""
    assert attacker.state == committed
    assert attacker.step(call("Observe")).observation == "ok"
    action, observation = next(steps)
    after = neighbour.step(action)
    assert after.resident and after.observation == observation
    assert stub.GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10).jails_replaced == replaced


def test_a_stale_state_runs_cold_from_that_state(stub: pb_grpc.SandboxServiceStub) -> None:
    """The runtime may commit nothing after a step (a lost reply): the next step starts from what it holds."""
    session = Session(stub, "stale", RESIDENT_ENV)
    committed = session.state
    assert session.step(call("Bump")).observation == "class 1 module 1 own 1"
    assert session.step(call("Bump")).resident
    session.state = committed  # as if neither step had been committed
    again = session.step(call("Bump"))
    assert not again.resident and again.observation == "class 1 module 1 own 1"


def test_a_process_that_leaves_a_thread_running_is_not_kept(stub: pb_grpc.SandboxServiceStub) -> None:
    """A thread left behind would run on while other sessions step: the answer stands, the process
    goes, and the next step runs cold from the committed state."""
    session = Session(stub, "linger", RESIDENT_ENV)
    assert session.step(call("Bump")).observation == "class 1 module 1 own 1"
    assert session.step(call("Bump")).resident
    assert session.step(call("Linger")).observation == "lingering"  # the answer stands
    after = session.step(call("Bump"))
    # The process was not kept: a fresh one (class and module state start again) from the committed
    # state (the env's own count goes on).
    assert not after.resident
    assert (
        after.observation.startswith("class 1 module 1 own ")
        and after.observation != "class 1 module 1 own 1"
    )


def test_a_file_a_resident_step_writes_is_gone_before_the_next_step_of_any_session(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    a, b = Session(stub, "tmp-a", RESIDENT_ENV), Session(stub, "tmp-b", RESIDENT_ENV)
    steps = [a.step(call("Scribble")), b.step(call("Scribble"))]
    steps += [a.step(call("Scribble")), b.step(call("Scribble")), a.step(call("Scribble"))]
    assert [r.observation for r in steps] == ["found []"] * 5
    assert [r.resident for r in steps] == [False, False, True, True, True]


def test_sessions_of_one_env_never_share_class_or_module_state(stub: pb_grpc.SandboxServiceStub) -> None:
    a, b = Session(stub, "share-a", RESIDENT_ENV), Session(stub, "share-b", RESIDENT_ENV)
    seen = [a.step(call("Bump")).observation, b.step(call("Bump")).observation]
    seen += [
        a.step(call("Bump")).observation,
        a.step(call("Bump")).observation,
        b.step(call("Bump")).observation,
    ]
    assert seen == [
        "class 1 module 1 own 1",
        "class 1 module 1 own 1",
        "class 2 module 2 own 2",
        "class 3 module 3 own 3",
        "class 2 module 2 own 2",
    ]


def test_a_step_that_times_out_leaves_the_committed_state_and_the_next_step_works(
    stub: pb_grpc.SandboxServiceStub,
) -> None:
    session = Session(stub, "slow", RESIDENT_ENV)
    assert session.step(call("Bump")).observation == "class 1 module 1 own 1"
    assert session.step(call("Bump")).resident
    timed_out = session.step(call("Slow"), pb.Limits(wall_ms=500, cpu_ms=400))
    assert timed_out.status == pb.STATUS_TIMEOUT
    after = session.step(call("Bump"))
    # Cold from the committed state (two Bumps): the class counter restarts, the env's own count does not.
    assert after.status == pb.STATUS_OK and not after.resident
    assert after.observation == "class 1 module 1 own 3"
    assert session.step(call("Bump")).resident


@pytest.mark.parametrize("bomb", ["Fork", "Hog"])
def test_a_bomb_in_one_resident_session_leaves_the_others_alive_and_correct(
    stub: pb_grpc.SandboxServiceStub, bomb: str
) -> None:
    others = [
        Session(stub, f"{bomb}-other-{i}", SOURCES[t["env_id"]], json.dumps(t["config"]))
        for i, t in enumerate(TRAJECTORIES[:3])
    ]
    steps = [iter(t["steps"]) for t in TRAJECTORIES[:3]]
    for session, it in zip(others, steps, strict=True):
        action, observation = next(it)
        assert session.step(action).observation == observation
    attacker = Session(stub, f"{bomb}-attacker", RESIDENT_ENV)
    assert attacker.step(call("Bump")).status == pb.STATUS_OK
    assert attacker.step(call("Bump")).resident
    bombed = attacker.step(call(bomb), pb.Limits(wall_ms=1500, cpu_ms=1000, memory_mb=64))
    assert bombed.status != pb.STATUS_OK
    for session, it in zip(others, steps, strict=True):
        action, observation = next(it)
        result = session.step(action)
        assert result.status == pb.STATUS_OK and result.resident and result.observation == observation
    recovered = attacker.step(call("Bump"))
    assert recovered.status == pb.STATUS_OK and recovered.observation == "class 1 module 1 own 3"


def test_a_released_session_is_dropped_and_its_next_step_runs_cold(stub: pb_grpc.SandboxServiceStub) -> None:
    session = Session(stub, "released", RESIDENT_ENV, resident_create=True)
    assert session.step(call("Bump")).resident
    release = pb.Operation(release=pb.ReleaseOp(session_key="released"))
    assert session.execute(release).status == pb.STATUS_OK
    after = session.step(call("Bump"))
    assert not after.resident and after.observation == "class 1 module 1 own 2"
    unknown = pb.Operation(release=pb.ReleaseOp(session_key="never-seen"))
    assert session.execute(unknown).status == pb.STATUS_OK
    with pytest.raises(grpc.RpcError) as info:
        session.execute(pb.Operation(release=pb.ReleaseOp()))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


ADMIT_IDLE_S = 0.3


def test_a_full_jail_keeps_its_residents_and_evicts_only_idle_ones() -> None:
    worker = start_worker("--resident-cap", "1", "--admit-idle-s", str(ADMIT_IDLE_S))
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            first, second = TRAJECTORIES[0], TRAJECTORIES[10]
            a = Session(
                stub, "full-a", SOURCES[first["env_id"]], json.dumps(first["config"]), resident_create=True
            )
            b = Session(
                stub, "full-b", SOURCES[second["env_id"]], json.dumps(second["config"]), resident_create=True
            )
            steps_a, steps_b = iter(first["steps"]), iter(second["steps"])
            resident_a, resident_b = [], []
            for _ in range(4):
                (action_a, obs_a), (action_b, obs_b) = next(steps_a), next(steps_b)
                ra = a.step(action_a)
                a_answered = time.monotonic()
                rb = b.step(action_b)
                assert (ra.observation, rb.observation) == (obs_a, obs_b)
                resident_a.append(ra.resident)
                resident_b.append(rb.resident)
            # Room for one: the first session stays warm; the newcomer runs cold instead of
            # evicting a session that is still stepping.
            assert all(resident_a) and not any(resident_b)
            # `a` idle past the admission threshold (by the monotonic clock the zygote reads, which
            # set `a`'s last use before answering): `b` may take its place.
            wait_until(lambda: time.monotonic() - a_answered > ADMIT_IDLE_S, 10, "`a` to sit idle")
            action_b, obs_b = next(steps_b)
            assert b.step(action_b).observation == obs_b
            action_b, obs_b = next(steps_b)
            assert b.step(action_b).resident
            action_a, obs_a = next(steps_a)
            evicted = a.step(action_a)
            assert not evicted.resident and evicted.observation == obs_a
    finally:
        assert worker.stop() == 0


def live_in_jails(root: int) -> list[int]:
    """The jailed processes that still run (a killed one may wait a request to be reaped)."""
    return [pid for pid in jailed(root) if (stat_fields(pid) or ["Z"])[0] not in ("Z", "X")]


def test_a_finished_episode_frees_its_process_and_a_reset_still_works() -> None:
    worker = start_worker()
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            line = next(t for t in TRAJECTORIES if len(t["steps"]) >= 3)
            config = json.dumps(line["config"])
            session = Session(stub, "finishing", SOURCES[line["env_id"]], config, resident_create=True)
            # The spare, and the session's own process.
            wait_until(lambda: len(live_in_jails(worker.pid)) == 2, 10, "the session's process and the spare")
            *playing, (last_action, last_observation) = line["steps"]
            for action, observation in playing:
                assert session.step(action).observation == observation
            wait_until(lambda: len(live_in_jails(worker.pid)) == 2, 10, "the session's process and the spare")
            last = session.step(last_action)
            assert last.done and last.resident and last.observation == last_observation
            # The episode is over: its process goes once the answer is out.
            wait_until(
                lambda: len(live_in_jails(worker.pid)) == 1, 10, "the finished session's process to end"
            )
            reset = session.execute(
                pb.Operation(
                    source=pb.SourceRef(code=session.source),
                    reset=pb.ResetOp(state=session.state, config_json=config),
                )
            )
            assert reset.status == pb.STATUS_OK and reset.observation == line["first"]
    finally:
        assert worker.stop() == 0


def test_a_worker_holds_only_the_residents_its_memory_budget_pays_for() -> None:
    # 4 MiB for one jail: one resident at the 3 MiB a resident is taken to cost until measured (not
    # measured again during the test: a sample that caught only the spare could make it cheaper).
    worker = start_worker("--resident-memory-mb", "4", "--resident-sample-s", "3600", "--metrics-port", "0")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            lines = [t for t in TRAJECTORIES if len(t["steps"]) >= 5][:2]
            sessions = [
                Session(
                    stub, f"budget-{i}", SOURCES[t["env_id"]], json.dumps(t["config"]), resident_create=True
                )
                for i, t in enumerate(lines)
            ]
            served = [[], []]
            for step in range(4):
                for i, (session, line) in enumerate(zip(sessions, lines, strict=True)):
                    action, observation = line["steps"][step]
                    result = session.step(action)
                    assert result.status == pb.STATUS_OK and result.observation == observation
                    served[i].append(result.resident)
            # The first keeps its process; the second, with no room, runs cold every time and
            # leaves no process behind (only the first's and the spare are there).
            assert served == [[True] * 4, [False] * 4]
            wait_until(
                lambda: len(live_in_jails(worker.pid)) == 2, 10, "the first session's process and the spare"
            )
            figures = scrape(metrics_address(worker))
            assert figures['codegym_sandbox_cold_steps_total{cause="full"}'] == 4
            assert figures["codegym_sandbox_resident_budget_bytes"] == 4 * 1024 * 1024
    finally:
        assert worker.stop() == 0


def test_what_a_resident_costs_is_measured_on_the_live_processes() -> None:
    worker = start_worker("--resident-sample-s", "0.2", "--metrics-port", "0")
    try:
        address = metrics_address(worker)
        assumed = scrape(address)["codegym_sandbox_resident_cost_bytes"]
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            lines = [t for t in TRAJECTORIES if len(t["steps"]) >= 2][:4]
            for i, line in enumerate(lines):
                session = Session(
                    stub,
                    f"cost-{i}",
                    SOURCES[line["env_id"]],
                    json.dumps(line["config"]),
                    resident_create=True,
                )
                assert session.step(line["steps"][0][0]).resident

            def measured() -> float:
                return scrape(address)["codegym_sandbox_resident_cost_bytes"]

            wait_until(lambda: measured() != assumed, 20, "a measurement of the residents")
            figures = scrape(address)
            cost = figures["codegym_sandbox_resident_cost_bytes"]
            # Private pages and page tables of a forked interpreter that ran a step: megabytes.
            assert 256 * 1024 <= cost <= 64 * 1024 * 1024
            assert figures["codegym_sandbox_residents"] == 4
            # The budget (half this machine's memory) holds more than the jail's ceiling at that cost.
            budget = figures["codegym_sandbox_resident_budget_bytes"]
            assert figures["codegym_sandbox_resident_capacity"] == min(JAIL_CEILING, budget // cost)
    finally:
        assert worker.stop() == 0


def test_a_session_stepping_further_apart_than_the_idle_time_gets_no_resident() -> None:
    worker = start_worker("--resident-idle-s", "5", "--metrics-port", "0")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            line = next(t for t in TRAJECTORIES if len(t["steps"]) >= 6)
            session = Session(stub, "sparse", SOURCES[line["env_id"]], json.dumps(line["config"]))
            served = []
            # The session's think time before each step: twice past the 5 s idle time, then within
            # it, then past it but within the 10 s its process is held, then past that.
            thinks_ms = (10_000, 10_000, 1_000, 1_000, 7_000, 12_000)
            for (action, observation), idle_ms in zip(line["steps"], thinks_ms, strict=False):
                op = pb.Operation(
                    source=pb.SourceRef(code=session.source),
                    limits=STEP_LIMITS,
                    step=pb.StepOp(
                        state=session.state, action=action, session_key=session.key, idle_ms=idle_ms
                    ),
                )
                result = session.execute(op)
                assert result.status == pb.STATUS_OK and result.observation == observation
                session.state = result.state
                served.append(result.resident)
            # The sparse steps ran one-shot and left no process; the first close one made the
            # session's resident, which served the next, and the one after a 7 s turn (a process
            # there already keeps serving within its hold time); 12 s is past it: one-shot again.
            assert served == [False, False, False, True, True, False]
            figures = scrape(metrics_address(worker))
            assert figures['codegym_sandbox_cold_steps_total{cause="sparse"}'] == 3
            assert figures["codegym_sandbox_resident_idle_seconds"] == 5
    finally:
        assert worker.stop() == 0


def test_a_resident_idle_past_twice_the_idle_time_goes() -> None:
    worker = start_worker("--resident-idle-s", "2", "--metrics-port", "0")
    try:
        address = metrics_address(worker)
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            line = next(t for t in TRAJECTORIES if len(t["steps"]) >= 3)
            config = json.dumps(line["config"])
            created = time.monotonic()
            idle = Session(stub, "idle", SOURCES[line["env_id"]], config, resident_create=True)
            assert scrape(address)["codegym_sandbox_residents"] == 1
            release = pb.Operation(release=pb.ReleaseOp(session_key="nobody"))

            def gone() -> bool:
                # The zygote looks for idle residents after each request it serves.
                stub.Execute(pb.ExecuteRequest(operation=release), timeout=10)
                return scrape(address).get('codegym_sandbox_evictions_total{reason="idle"}', 0) == 1

            wait_until(gone, 20, "the idle resident to go", poll_s=0.2)
            # Twice the idle time: a step delayed by load must not find its session evicted.
            assert time.monotonic() - created >= 4
            assert scrape(address)["codegym_sandbox_residents"] == 0
            # Its next step runs cold from the committed state, as after a worker's death.
            action, observation = line["steps"][0]
            result = idle.step(action)
            assert result.status == pb.STATUS_OK and not result.resident and result.observation == observation
    finally:
        assert worker.stop() == 0


def test_a_resident_is_held_longer_while_steps_reach_their_jail_late() -> None:
    worker = start_worker("--resident-idle-s", "1")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SandboxServiceStub(channel)
            line = next(t for t in TRAJECTORIES if len(t["steps"]) >= 3)
            config = json.dumps(line["config"])
            a = Session(stub, "late-a", SOURCES[line["env_id"]], config, resident_create=True)
            b = Session(stub, "late-b", SOURCES[line["env_id"]], config, resident_create=True)
            answered = time.monotonic()
            # Both sit idle 3 s by the jail's clock, past the 2 s a resident is held.
            wait_until(lambda: time.monotonic() - answered > 3, 10, "3 s of idleness")
            action, observation = line["steps"][0]

            def step(session: Session) -> pb.OperationResult:
                # Each session thought 0.1 s by the runtime's clock: the rest was queueing.
                op = pb.Operation(
                    source=pb.SourceRef(code=session.source),
                    limits=STEP_LIMITS,
                    step=pb.StepOp(state=session.state, action=action, session_key=session.key, idle_ms=100),
                )
                result = session.execute(op)
                assert result.status == pb.STATUS_OK and result.observation == observation
                return result

            # `a`'s step tells the worker how late steps come; the look for idle residents after it
            # holds them that much longer, so `b`, as late, still finds its process.
            assert step(a).resident
            assert step(b).resident
    finally:
        assert worker.stop() == 0


def test_the_idle_time_is_derived_from_a_residents_cost_and_a_cold_steps_cpu() -> None:
    from sandbox_worker.residency import COLD_STEP_CPU_S, DEFAULT_COST, WARM_STEP_CPU_S, memory_per_cpu

    # Not measured during the test: the cost stays the 3 MiB a resident is taken to cost until then.
    worker = start_worker("--resident-sample-s", "3600", "--metrics-port", "0")
    try:
        figures = scrape(metrics_address(worker))
        derived = (COLD_STEP_CPU_S - WARM_STEP_CPU_S) * memory_per_cpu() / DEFAULT_COST
        assert figures["codegym_sandbox_resident_idle_seconds"] == pytest.approx(min(600, max(2, derived)))
    finally:
        assert worker.stop() == 0


def test_a_jails_process_tree_is_read_from_children_files_as_a_scan_of_proc_reads_it() -> None:
    """`sample_cost` finds the zygotes' children from /proc/PID/task/*/children (through
    `codegym.proctree`), not by reading the stat of every process on the machine; both give the
    same children."""
    from codegym.proctree import children_by_parent, children_of, children_reader

    sleepers = [subprocess.Popen(["sleep", "30"]) for _ in range(3)]
    try:
        direct = children_of(os.getpid())
        assert direct is not None and {p.pid for p in sleepers} <= set(direct)
        assert sorted(direct) == sorted(children_by_parent().get(os.getpid(), []))
        assert sorted(children_reader()(os.getpid())) == sorted(direct)
        assert children_of(sleepers[0].pid) == []
    finally:
        for proc in sleepers:
            proc.kill()
            proc.wait()
    assert children_of(sleepers[0].pid) == []  # gone: no children, never an error
