"""Creates that copy a recently built initial state (services/runtime/initial_states.py), against a
real runtime and real sandbox workers.

A configuration's first two builds (different seeds) are compared; when they agree, its later
creates copy that state with no sandbox call, and play the same episode as a built one (the
recorded oracle trajectories are replayed through both). A configuration whose construction draws
from the seed is built every time, and what the copies hold stays within its byte budget.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from codegym.sandbox.v1 import sandbox_service_pb2 as pb
from codegym.sandbox.v1 import sandbox_service_pb2_grpc as pb_grpc
from codegym_client.errors import EnvFailed
from codegym_client.runtime_client import RuntimeClient
from tests.conftest import SAMPLES
from tests.helpers.libraries import SAMPLE_LIBRARY, build_library
from tests.helpers.servers import CodegymServer, start_runtime, workers_fixture
from tests.test_metrics import metrics_address, scrape

pytestmark = pytest.mark.jail  # every create and step runs in real sandbox workers

TRAJECTORIES = [json.loads(x) for x in (SAMPLES / "trajectories.jsonl").read_text().splitlines()]
STATES = 'codegym_cache_{}{{cache="runtime_initial_states"{}}}'
BUDGET_MB = 1

# Shared by the two environments written here: the tools and the episode's end as CodeGym's are.
TEMPLATE = '''import json
import random

import gymnasium


class {name}(gymnasium.Env):
    """{doc}"""

    def __init__(self, env_str: str = None):
        super().__init__()
        self.func_mapping = {{"Look": 0, "Done": 1}}
        self.reset(json.loads(env_str.split("@", 1)[1]) if env_str is not None else {{}})

    @property
    def finished(self) -> bool:
        return self._done

    @property
    def reward(self):
        return float(self._reward)

    @staticmethod
    def from_env_str(env_str: str):
        if not env_str.startswith("{name}@"):
            return None
        return {name}(env_str=env_str)

    def reset(self, options: dict = None):
        options = options or {{}}
{reset}
        self._reward = 0
        self._done = False
        return "ready: " + str(options.get("label", ""))

    def get_ref_answer(self):
        return self.answer

    def step(self, action: str):
        call = json.loads(action)
        name, params = call["name"], call.get("parameters", {{}})
        try:
            msg = getattr(self, name)(**params)
        except TypeError as exc:
            msg = f"Error: {{exc}}"
        return True, msg

    def Look(self):
        r"""

        Show what the episode started with.

        Args:
            None

        Returns:
            str: The value.

        Example Output:
            "12"
        """
        return str(self.answer)

    def Done(self, answer: int):
        r"""

        End the episode with an answer.

        Args:
            answer (int): The answer.

        Returns:
            str: Result information, including correctness and reward.

        Example Output:
            "Your answer: 12, Result: Correct, reward=1"
        """
        correct = answer == self.answer
        self._reward = 1 if correct else 0
        self._done = True
        return f"Your answer: {{answer}}, Result: {{'Correct' if correct else 'Incorrect'}}, reward={{self._reward}}"
'''
# Draws its secret from the module's `random`, which the jail seeds with the create's seed; its
# first observation does not show it, so only the state bytes tell two seeds apart.
TOSS = TEMPLATE.format(
    name="TossEnv",
    doc="A secret drawn at reset from the seeded random: every seed starts another episode.",
    reset="        self.answer = random.randint(0, 10**9)",
)
# Seed-independent, with a state of about `n` x 110 bytes (distinct strings: pickle keeps each);
# a config with "fail" cannot start.
BULKY = TEMPLATE.format(
    name="BulkyEnv",
    doc="A large state made from the config alone.",
    reset=(
        '        if options.get("fail"):\n'
        '            raise RuntimeError("this config cannot start")\n'
        '        label = options.get("label", "")\n'
        '        self.items = [f"{label}-{i}-" + "x" * 100 for i in range(int(options.get("n", 1)))]\n'
        "        self.answer = len(self.items)"
    ),
)
LOOK = '{"name": "Look", "parameters": {}}'

workers = workers_fixture(2)


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("initial-states")
    written = []
    for env_id, source in (("Test_0101_I__TossEnv", TOSS), ("Test_0102_I__BulkyEnv", BULKY)):
        path = folder / f"{env_id}.py"
        path.write_text(source)
        written.append(path)
    return build_library(folder / "library.db", SAMPLE_LIBRARY, written)


@pytest.fixture(scope="module")
def runtime(library: Path, workers: list[CodegymServer]) -> Iterator[CodegymServer]:
    proc = start_runtime(library, workers, "--metrics-port", "0", "--initial-states-mb", str(BUDGET_MB))
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(runtime: CodegymServer) -> Iterator[RuntimeClient]:
    with RuntimeClient(runtime.address, timeout_s=60) as c:
        yield c


def sandbox_operations(workers: list[CodegymServer]) -> int:
    """Operations the workers have run so far (every create that builds is one)."""
    total = 0
    for worker in workers:
        with grpc.insecure_channel(worker.address) as channel:
            info = pb_grpc.SandboxServiceStub(channel).GetWorkerInfo(pb.GetWorkerInfoRequest(), timeout=10)
            total += info.operations
    return total


def metric(runtime: CodegymServer, name: str, labels: str = "") -> float:
    return scrape(metrics_address(runtime)).get(STATES.format(name, labels), 0.0)


def replay(client: RuntimeClient, session_id: str, line: dict[str, Any]) -> None:
    """The recorded oracle trajectory, step by step, with its recorded observations and reward."""
    for index, (action, observation) in enumerate(line["steps"]):
        response = client.step(session_id, action)
        assert not response.HasField("error"), response.error
        assert response.observation == observation, (line["env_id"], index, action)
    assert response.done and response.reward == line["reward"] == 1


def test_a_seed_independent_configuration_is_built_twice_then_copied_and_plays_the_same_episode(
    client: RuntimeClient, runtime: CodegymServer, workers: list[CodegymServer]
) -> None:
    line = next(x for x in TRAJECTORIES if x["steps"] and x["env_id"].endswith("MaxSubarraySumEnv"))
    before = sandbox_operations(workers)
    built = [client.create_session(env_id=line["env_id"], config=line["config"]) for _ in range(2)]
    assert sandbox_operations(workers) == before + 2  # the two trials, each a sandbox create
    hits = metric(runtime, "events_total", ',event="hit"')
    copied = client.create_session(env_id=line["env_id"], config=line["config"])
    # A seed of its own named by the caller copies too: the construction was measured not to use it.
    seeded = client.create_session(env_id=line["env_id"], config=line["config"], seed=12345)
    assert sandbox_operations(workers) == before + 2, "a copied create called a sandbox"
    assert metric(runtime, "events_total", ',event="hit"') == hits + 2
    for made in (copied, seeded):
        assert made.observation == built[0].observation == line["first"]
        assert (made.tools, made.tools_text, made.task_text, made.env_id, made.max_steps) == (
            built[0].tools,
            built[0].tools_text,
            built[0].task_text,
            built[0].env_id,
            built[0].max_steps,
        )
    # The same episode, whether its state was built (its first step in the process that built
    # it) or copied (its first step cold from the state, on whichever worker).
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda made: replay(client, made.session_id, line), [*built, copied, seeded]))


def test_the_creates_of_a_batch_sent_at_once_build_two_and_copy_the_rest(
    client: RuntimeClient, workers: list[CodegymServer]
) -> None:
    line = next(x for x in TRAJECTORIES if x["steps"] and x["env_id"].endswith("MaxSubarraySumEnv"))
    config = {**line["config"], "nums": [*line["config"]["nums"], 7]}  # a configuration new here
    before = sandbox_operations(workers)
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda _: client.create_session(env_id=line["env_id"], config=config), range(8)))
    assert sandbox_operations(workers) == before + 2
    assert len({m.observation for m in made}) == 1
    assert len({m.session_id for m in made}) == 8


def test_a_configuration_whose_construction_draws_from_the_seed_is_never_copied(
    client: RuntimeClient, workers: list[CodegymServer]
) -> None:
    config = {"label": "toss"}
    seeds = [11, 22, 33, 44, 11]
    before = sandbox_operations(workers)
    sessions = [client.create_session(env_id="Test_0101_I__TossEnv", config=config, seed=s) for s in seeds]
    assert sandbox_operations(workers) == before + len(seeds)  # every create built
    # Every episode drew its own seed's secret, though all first observations read alike.
    assert len({s.observation for s in sessions}) == 1
    secrets = [client.step(s.session_id, LOOK).observation for s in sessions]
    for seed, secret in zip(seeds, secrets, strict=True):
        # The construction resets once in from_env_str and once more as the jail starts it.
        rng = random.Random(seed)
        assert secret in {str(rng.randint(0, 10**9)) for _ in range(2)}
    assert secrets[0] == secrets[-1] and len(set(secrets)) == 4
    # Known now to depend on the seed: later creates build without waiting for a verdict.
    before = sandbox_operations(workers)
    with ThreadPoolExecutor(4) as pool:
        later = list(
            pool.map(lambda _: client.create_session(env_id="Test_0101_I__TossEnv", config=config), range(4))
        )
    assert sandbox_operations(workers) == before + 4
    looks = {client.step(s.session_id, LOOK).observation for s in later}
    assert len(looks) == 4


def test_the_initial_states_held_stay_within_their_byte_budget(
    client: RuntimeClient, runtime: CodegymServer, workers: list[CodegymServer]
) -> None:
    budget = BUDGET_MB << 20
    assert metric(runtime, "capacity_bytes") == budget
    # 20 configurations of about 110 KB each: twice what the budget holds.
    configs = [{"label": f"bulk{i}", "n": 1000} for i in range(20)]
    evictions = metric(runtime, "events_total", ',event="eviction"')
    for config in configs:
        for _ in range(2):  # the two trials: the state is then held
            client.create_session(env_id="Test_0102_I__BulkyEnv", config=config)
        held = metric(runtime, "bytes")
        assert 100_000 <= held <= budget
    assert metric(runtime, "events_total", ',event="eviction"') > evictions
    assert metric(runtime, "entries") < len(configs)
    # The most recent configuration is still held and copied; the first was evicted and is
    # measured again (two builds before it copies).
    before = sandbox_operations(workers)
    latest = client.create_session(env_id="Test_0102_I__BulkyEnv", config=configs[-1])
    assert sandbox_operations(workers) == before
    first = client.create_session(env_id="Test_0102_I__BulkyEnv", config=configs[0])
    assert sandbox_operations(workers) == before + 1
    for session in (latest, first):
        assert client.step(session.session_id, LOOK).observation == "1000"


def test_a_configuration_that_cannot_start_fails_every_create_and_holds_none_back(
    client: RuntimeClient, workers: list[CodegymServer]
) -> None:
    config = {"label": "broken", "fail": 1}

    def create(_: int) -> str:
        with pytest.raises(EnvFailed) as failed:
            client.create_session(env_id="Test_0102_I__BulkyEnv", config=config)
        return str(failed.value)

    before = sandbox_operations(workers)
    # Sent at once: two are trials, the rest wait for a verdict that never comes (both trials
    # fail), then build themselves; each gets the environment's own error, none waits for ever.
    with ThreadPoolExecutor(6) as pool:
        messages = list(pool.map(create, range(6)))
    assert all("this config cannot start" in message for message in messages)
    assert sandbox_operations(workers) == before + 6
    # Nothing of it is held: a configuration of the same environment that starts is measured as usual.
    good = {"label": "fine", "n": 3}
    built = [client.create_session(env_id="Test_0102_I__BulkyEnv", config=good) for _ in range(2)]
    before = sandbox_operations(workers)
    copied = client.create_session(env_id="Test_0102_I__BulkyEnv", config=good)
    assert sandbox_operations(workers) == before
    assert copied.observation == built[0].observation == "ready: fine"
