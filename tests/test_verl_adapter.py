"""The verl adapter (`codegym_client.verl`) against a real runtime and sandbox worker serving the sample
library (and, for an outage the episode waits out, runtime replicas sharing their sessions in
Redis). The episode driver (`run_episode`, what `CodeGymAgentLoop.run` plays) runs with a scripted
`generate` replaying recorded oracle trajectories as hermes tool calls (codegym_testkit/trainer_script.py).
No verl, no torch: `CodeGymAgentLoop` and `CodeGymTool` run here against stand-ins of verl 0.8's
interfaces; tests/test_verl_real.py runs them in verl itself (`make test-trainers`)."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from codegym_client import AsyncRuntimeClient, EnvNotFound, SessionNotFound
from codegym_client.abilities import make_ability
from codegym_client.errors import EpisodeEnded, InfrastructureFailure
from codegym_client.verl import run_episode, text_tool_parser, tool_config, visible_text
from codegym_testkit.trainer_script import (
    TOKENIZER,
    TRAJECTORIES,
    ScriptedModel,
    ability,
    call_as_tool_agent_loop,
    hermes,
    model_text,
    oracle_turns,
    trajectory,
)
from tests.helpers.libraries import SAMPLE_LIBRARY, library_fixture
from tests.helpers.processes import wait_until
from tests.helpers.servers import CodegymServer, Redis, worker_fixture

library = library_fixture(SAMPLE_LIBRARY)
worker = worker_fixture()


def start_runtime(library: Path, worker: CodegymServer) -> CodegymServer:
    return CodegymServer(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
    )


@pytest.fixture(scope="module")
def runtime(library: Path, worker: CodegymServer) -> Iterator[str]:
    server = start_runtime(library, worker)
    try:
        yield server.address
    finally:
        assert server.stop() == 0


@pytest.mark.jail
async def test_a_recorded_oracle_episode_reaches_reward_1_and_its_session_is_closed(runtime: str) -> None:
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    model = ScriptedModel(oracle_turns(recorded))
    opened: list[str] = []
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        create = client.create_session

        async def counting(**kwargs: Any) -> Any:
            created = await create(**kwargs)
            opened.append(created.session_id)
            return created

        client.create_session = counting  # type: ignore[method-assign]
        episode = await run_episode(client, ability(recorded), tokenizer=TOKENIZER, generate=model)
        assert (episode.reward, episode.done, episode.truncated, episode.stop) == (1.0, True, False, "done")
        assert not episode.infrastructure_failure and episode.failure_reason == ""
        assert episode.steps == len(recorded["steps"]) == episode.assistant_turns
        assert episode.env_id == recorded["env_id"]
        assert opened == [episode.session_id]  # one session for the whole episode
        with pytest.raises(SessionNotFound):  # closed in `finally`
            await client.get_session(episode.session_id)

    # The prompt: the session's task and tools through the chat template.
    prompt = TOKENIZER.decode(episode.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert '"name": "GetElement"' in prompt and "<|im_start|>user\n" in prompt
    # Each turn saw the recorded observation of the previous call, rendered as verl renders tool
    # messages (chat template, system prompt cut off), and nothing else was added between turns.
    for k, (_, observation) in enumerate(recorded["steps"][:-1]):
        expected = f"<tool_response>\n{observation}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert model.prompts[k + 1].endswith(expected), k
        assert model.prompts[k + 1].count("<|im_start|>system") == 1
    assert model.prompts[-1] == TOKENIZER.decode(
        episode.prompt_ids + episode.response_ids[: -len(TOKENIZER.encode(oracle_turns(recorded)[-1]))]
    )
    # The mask: 1 exactly on the model's tokens; the episode ends on the model's final call.
    assert model_text(episode) == "".join(oracle_turns(recorded))
    assert len(episode.response_ids) == len(episode.response_mask) and episode.response_mask[-1] == 1
    assert episode.response_logprobs is None
    assert episode.num_turns == episode.assistant_turns + episode.user_turns + 1
    assert episode.user_turns == len(recorded["steps"]) - 1
    fields = episode.extra_fields()
    assert fields["codegym_infrastructure_failure"] is False and fields["codegym_stop"] == "done"


@pytest.mark.jail
@pytest.mark.parametrize(
    ("cap", "stop"), [({"max_turns": 3}, "max_turns"), ({"max_user_turns": 2}, "max_user_turns")]
)
async def test_the_turn_that_reaches_a_cap_ends_the_response_and_its_call_is_not_run(
    runtime: str, cap: dict[str, int], stop: str
) -> None:
    """As verl's ToolAgentLoop: the caps are checked right after a model turn, so the third turn
    (after two tool-message turns) is the response's end and its call is never stepped."""
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    model = ScriptedModel(oracle_turns(recorded))
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        episode = await run_episode(client, ability(recorded), tokenizer=TOKENIZER, generate=model, **cap)
    assert episode.stop == stop and not episode.done and not episode.infrastructure_failure
    assert (episode.assistant_turns, episode.user_turns, episode.steps) == (3, 2, 2)
    assert model_text(episode) == "".join(oracle_turns(recorded)[:3])
    assert episode.response_mask[-1] == 1  # the capped turn is the last thing in the response


@pytest.mark.jail
async def test_tool_calls_inside_think_are_not_run(runtime: str) -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    wrong = hermes('{"name": "Done", "parameters": {"answer": -1}}')  # would end it with reward 0
    turns = [
        f"<think>Maybe {wrong}? No: look first.</think>\n{hermes(action)}<|im_end|>"
        for action, _ in recorded["steps"]
    ]
    turns[0] = f"<think>{wrong}</think>{hermes(recorded['steps'][0][0])}<|im_end|>"
    model = ScriptedModel(turns)
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        episode = await run_episode(client, ability(recorded), tokenizer=TOKENIZER, generate=model)
        assert (episode.reward, episode.stop, episode.steps) == (1.0, "done", len(recorded["steps"]))
        # A turn whose only call is in its reasoning (here cut off unclosed) calls nothing.
        only_thought = ScriptedModel(["<think>Let me answer " + wrong, "never reached"])
        ended = await run_episode(client, ability(recorded), tokenizer=TOKENIZER, generate=only_thought)
        assert (ended.stop, ended.steps, ended.reward, ended.done) == ("no_tool_call", 0, 0.0, False)
        assert ended.assistant_turns == 1 and set(ended.response_mask) == {1}
        with pytest.raises(SessionNotFound):
            await client.get_session(ended.session_id)


def test_visible_text_drops_reasoning() -> None:
    assert visible_text("<think>a <tool_call>x</tool_call></think>b") == "b"
    assert visible_text("reasoning opened by the template</think>answer") == "answer"
    assert visible_text("a<think>b</think>c<think>d</think>e") == "ace"
    assert visible_text("answer<think>cut off <tool_call>") == "answer"
    assert visible_text("no reasoning") == "no reasoning"


@pytest.mark.jail
async def test_the_codegym_text_format_and_a_refused_step_are_observations(runtime: str) -> None:
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    turns = [
        '<|FunctionCallBegin|>[{"name": "NoSuchTool", "parameters": {}}]<|FunctionCallEnd|>',
        *[f"<|FunctionCallBegin|>[{action}]<|FunctionCallEnd|>" for action, _ in recorded["steps"]],
    ]
    model = ScriptedModel(turns)
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        episode = await run_episode(
            client,
            ability(recorded),
            tokenizer=TOKENIZER,
            generate=model,
            parse_tool_calls=text_tool_parser("codegym", TOKENIZER),
            messages=[{"role": "user", "content": "Solve the task."}],
        )
    assert (episode.reward, episode.stop, episode.steps) == (1.0, "done", len(recorded["steps"]) + 1)
    assert "NoSuchTool" in model.prompts[1].rsplit("<tool_response>", 1)[1]  # the env's answer, shown
    assert "Solve the task." in model.prompts[0]
    assert not episode.infrastructure_failure


@pytest.mark.jail
async def test_a_row_the_runtime_does_not_know_raises(runtime: str) -> None:
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        with pytest.raises(EnvNotFound):  # the data is wrong: not an outage, not an episode
            await run_episode(
                client,
                make_ability("Nope_0000_I__NoEnv", {"a": 1}),
                tokenizer=TOKENIZER,
                generate=ScriptedModel([]),
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.jail
async def test_an_unreachable_runtime_ends_the_episode_flagged_without_an_observation(
    library: Path, worker: CodegymServer
) -> None:
    # Unreachable from the start: no session, no model turn, the flag.
    async with AsyncRuntimeClient(f"127.0.0.1:{free_port()}", timeout_s=2, attempts=2) as client:
        model = ScriptedModel(["never"])
        episode = await run_episode(
            client, ability(TRAJECTORIES[0]), tokenizer=TOKENIZER, generate=model, outage_wait_s=0
        )
    assert episode.infrastructure_failure and episode.stop == "infrastructure"
    assert "UNAVAILABLE" in episode.failure_reason
    assert (model.prompts, episode.response_ids, episode.session_id, episode.reward) == ([], [], "", 0.0)

    # Lost in the middle: the runtime stops after two steps; the third call's fault ends the episode.
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    server = start_runtime(library, worker)
    stopped = False
    turns = oracle_turns(recorded)

    async def generate(prompt_ids: list[int]) -> Any:
        nonlocal stopped
        prompts.append(TOKENIZER.decode(prompt_ids))
        if len(prompts) == 3:
            assert server.stop() == 0
            stopped = True
        return SimpleNamespace(token_ids=TOKENIZER.encode(turns[len(prompts) - 1]))

    prompts: list[str] = []
    try:
        async with AsyncRuntimeClient(server.address, timeout_s=2, attempts=2) as client:
            episode = await run_episode(
                client, ability(recorded), tokenizer=TOKENIZER, generate=generate, outage_wait_s=0
            )
    finally:
        if not stopped:
            server.stop()
    assert episode.infrastructure_failure and episode.stop == "infrastructure" and not episode.done
    assert episode.failure_reason.startswith("Step: UNAVAILABLE"), episode.failure_reason
    assert (episode.steps, episode.assistant_turns, episode.user_turns, episode.reward) == (2, 3, 2, 0.0)
    # The trajectory ends on the model's third turn: the fault's text is no tool message.
    text = TOKENIZER.decode(episode.response_ids)
    assert text.count("<tool_response>") == 2 and text.endswith(turns[2])
    assert "unavailable" not in text.lower() and "error" not in text.lower()
    assert episode.response_mask[-1] == 1
    assert episode.extra_fields()["codegym_infrastructure_failure"] is True


def test_tool_config_lists_one_codegym_tool_per_schema() -> None:
    schemas = [{"type": "function", "function": {"name": "Observe", "description": "d", "parameters": {}}}]
    config = tool_config(schemas, "127.0.0.1:50051")
    assert config["tools"][0]["class_name"] == "codegym_client.verl.tool.CodeGymTool"
    assert config["tools"][0]["config"] == {"type": "native", "target": "127.0.0.1:50051"}
    assert config["tools"][0]["tool_schema"] == schemas[0]


# -- verl's interfaces as stand-ins ------------------------------------------------------------------
# Without verl, `agent_loop.py` and `tool.py` run against stand-ins of the few verl names they use,
# written to verl's code (verl/experimental/agent_loop/agent_loop.py, tool_parser.py,
# verl/tools/base_tool.py, schemas.py at verl 0.8: no Continuous Token builder, so the episode renders
# with the chat template): this checks the glue (config reading, run()'s
# arguments and output, the tool's create/execute/release per call), not verl itself.

OUTPUT_FIELDS = {
    "prompt_ids",
    "response_ids",
    "response_mask",
    "response_logprobs",
    "routed_experts",
    "multi_modal_data",
    "reward_score",
    "num_turns",
    "metrics",
    "extra_fields",
}


class Conf(dict[str, Any]):
    """An OmegaConf DictConfig as the loop reads one: attributes and `.get`."""

    def __getattr__(self, name: str) -> Any:
        value = self[name]
        return Conf(value) if isinstance(value, dict) else value


def fake_verl_modules() -> dict[str, Any]:
    import re
    from types import ModuleType

    registry: dict[str, dict[str, str]] = {}

    def register(agent_name: str) -> Any:
        def decorator(subclass: type) -> type:
            registry[agent_name] = {"_target_": f"{subclass.__module__}.{subclass.__qualname__}"}
            return subclass

        return decorator

    class AgentLoopBase:
        def __init__(
            self, trainer_config: Any, server_manager: Any, tokenizer: Any, processor: Any, **kwargs: Any
        ):
            self.config = trainer_config.config
            self.server_manager = server_manager
            self.tokenizer = tokenizer
            self.processor = processor
            self.apply_chat_template_kwargs = kwargs["dataset_config"].config.get(
                "apply_chat_template_kwargs", {}
            )

        async def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
            return list(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True))

    class AgentLoopOutput:
        def __init__(self, **fields: Any) -> None:
            assert set(fields) <= OUTPUT_FIELDS, set(fields) - OUTPUT_FIELDS
            assert {"prompt_ids", "response_ids", "response_mask", "metrics"} <= set(fields)
            self.__dict__.update({"reward_score": None, "num_turns": 0, "extra_fields": {}, **fields})

    class FunctionCall:
        def __init__(self, name: str, arguments: str) -> None:
            self.name, self.arguments = name, arguments

    class HermesToolParser:  # verl's, on decoded ids (it does not skip <think>)
        def __init__(self, tokenizer: Any) -> None:
            self.tokenizer = tokenizer

        async def extract_tool_calls(self, ids: list[int]) -> tuple[str, list[Any]]:  # 0.8: ids only
            text = self.tokenizer.decode(ids)
            calls = []
            for match in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
                call = json.loads(match)
                calls.append(FunctionCall(call["name"], json.dumps(call["arguments"])))
            return text, calls

    class ToolParser:
        @classmethod
        def get_tool_parser(cls, name: str, tokenizer: Any) -> Any:
            assert name == "hermes", name
            return HermesToolParser(tokenizer)

    class ToolResponse:
        def __init__(self, text: str | None = None) -> None:
            self.text = text

    class OpenAIFunctionToolSchema(dict[str, Any]):
        @classmethod
        def model_validate(cls, value: dict[str, Any]) -> OpenAIFunctionToolSchema:
            assert value["type"] == "function" and value["function"]["name"], value
            return cls(value)

    class BaseTool:
        def __init__(self, config: dict[str, Any], tool_schema: Any) -> None:
            self.config, self.tool_schema = config, tool_schema
            self.name = tool_schema["function"]["name"]

    modules: dict[str, Any] = {}
    for name in (
        "verl",
        "verl.experimental",
        "verl.experimental.agent_loop",
        "verl.experimental.agent_loop.agent_loop",
        "verl.experimental.agent_loop.tool_parser",
        "verl.tools",
        "verl.tools.base_tool",
        "verl.tools.schemas",
    ):
        modules[name] = ModuleType(name)
    loop_module = modules["verl.experimental.agent_loop.agent_loop"]
    loop_module.AgentLoopBase, loop_module.AgentLoopOutput = AgentLoopBase, AgentLoopOutput
    loop_module.register, loop_module._agent_loop_registry = register, registry
    modules["verl.experimental.agent_loop.tool_parser"].ToolParser = ToolParser
    modules["verl.tools.base_tool"].BaseTool = BaseTool
    modules["verl.tools.schemas"].ToolResponse = ToolResponse
    modules["verl.tools.schemas"].OpenAIFunctionToolSchema = OpenAIFunctionToolSchema
    return modules


@pytest.fixture
def verl_stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    import sys

    import codegym_client.verl as package

    ours = ("codegym_client.verl.agent_loop", "codegym_client.verl.tool")
    saved = {name: sys.modules.pop(name) for name in ours if name in sys.modules}
    modules = fake_verl_modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    try:
        yield modules
    finally:
        for name in ours:
            sys.modules.pop(name, None)
            if hasattr(package, name.rsplit(".", 1)[1]):
                delattr(package, name.rsplit(".", 1)[1])
        sys.modules.update(saved)


@pytest.mark.jail
async def test_the_agent_loop_against_verl_stand_ins(runtime: str, verl_stand_ins: dict[str, Any]) -> None:
    from codegym_client.verl import AGENT_NAME, CodeGymAgentLoop

    registry = verl_stand_ins["verl.experimental.agent_loop.agent_loop"]._agent_loop_registry
    assert registry[AGENT_NAME] == {"_target_": "codegym_client.verl.agent_loop.CodeGymAgentLoop"}
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    wrong = hermes('{"name": "Done", "parameters": {"answer": -1}}')
    turns = [f"<think>{wrong}</think>{t}" for t in oracle_turns(recorded)]
    model = ScriptedModel(turns)
    requests: list[str] = []

    class ServerManager:  # AsyncLLMServerManager.generate's signature
        async def generate(
            self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
        ) -> Any:
            assert sampling_params == {"temperature": 1.0}
            requests.append(request_id)
            return await model(prompt_ids)

    config = Conf(
        actor_rollout_ref={
            "rollout": {
                "response_length": 1 << 20,
                "multi_turn": {
                    "format": "hermes",
                    "max_assistant_turns": None,
                    "max_tool_response_length": 256,
                    "tool_response_truncate_side": "middle",
                },
            }
        }
    )
    wrap = SimpleNamespace
    loop = CodeGymAgentLoop(
        wrap(config=config),
        ServerManager(),
        TOKENIZER,
        None,
        dataset_cls=None,
        dataset_config=wrap(config=Conf()),
        target=runtime,
    )
    # verl passes the row's columns: agent_name is consumed by the worker, the rest reach run().
    row = {"ability": ability(recorded), "raw_prompt": [{"role": "user", "content": "Go."}], "index": 3}
    output = await loop.run({"temperature": 1.0}, **row)
    assert output.reward_score == 1.0 and output.extra_fields["codegym_infrastructure_failure"] is False
    assert output.extra_fields["codegym_steps"] == len(recorded["steps"])  # the calls in <think> not run
    assert len(set(requests)) == 1 and len(requests) == len(recorded["steps"])  # one sticky request id
    assert len(output.response_ids) == len(output.response_mask) and output.response_mask[-1] == 1
    assert TOKENIZER.decode(output.prompt_ids).endswith("Go.<|im_end|>\n<|im_start|>assistant\n")
    assert output.num_turns == 2 * len(recorded["steps"])

    # An unreachable runtime: the row's prompt, one masked token, the flag, no model turn.
    down = CodeGymAgentLoop(
        wrap(config=config),
        ServerManager(),
        TOKENIZER,
        None,
        dataset_config=wrap(config=Conf()),
        target=f"127.0.0.1:{free_port()}",
        timeout_s=2,
        outage_wait_s=0,
    )
    before = len(requests)
    output = await down.run({"temperature": 1.0}, **row)
    assert output.extra_fields["codegym_infrastructure_failure"] is True and output.reward_score == 0.0
    assert (output.response_mask, len(requests)) == ([0], before)
    assert TOKENIZER.decode(output.prompt_ids).endswith("Go.<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.jail
async def test_the_tool_against_verl_stand_ins(runtime: str, verl_stand_ins: dict[str, Any]) -> None:
    from codegym_client.verl import CodeGymTool

    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 3)
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        schemas = [json.loads(t.json_schema) for t in (await client.get_env(recorded["env_id"])).tools]
        tools = {s["function"]["name"]: CodeGymTool({"target": runtime}, s) for s in schemas}
        agent_data = SimpleNamespace(
            request_id=f"episode-{id(tools)}",
            tools_kwargs={"any": {"create_kwargs": {"ability": ability(recorded)}}},
        )
        rewards = []
        for action, observation in recorded["steps"]:
            response, reward = await call_as_tool_agent_loop(tools, action, agent_data)
            assert response.text == observation
            rewards.append(reward)
            if len(rewards) == 1:  # one session for the episode, across tool instances
                session_id = CodeGymTool._sessions[agent_data.request_id].session_id
        assert rewards[-1] == 1.0 and sum(rewards) == 1.0
        assert agent_data.request_id not in CodeGymTool._sessions
        with pytest.raises(SessionNotFound):  # the step that ended the episode closed it
            await client.get_session(session_id)
        instance_id, _ = await tools["Observe"].create()
        with pytest.raises(EpisodeEnded):
            await tools["Observe"].execute(instance_id, {}, agent_data=agent_data)


# -- outages, failed rows, the tool's bound ------------------------------------------------------------


class ScriptedServer:
    """`AsyncLLMServerManager.generate` answered by a scripted model; `before(k)` runs before the
    k-th model turn (from 1) is answered: the moment a test breaks the runtime."""

    def __init__(self, model: ScriptedModel, before: Callable[[int], None] = lambda _: None) -> None:
        self.model = model
        self.before = before
        self.turns = 0

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ) -> Any:
        self.turns += 1
        self.before(self.turns)
        return await self.model(prompt_ids)


def stand_in_loop(target: str, server: ScriptedServer, **kwargs: Any) -> Any:
    """`CodeGymAgentLoop` as verl builds it, on the stand-ins (tool messages not truncated)."""
    from codegym_client.verl import CodeGymAgentLoop

    config = Conf(
        actor_rollout_ref={
            "rollout": {
                "response_length": 1 << 20,
                "multi_turn": {"format": "hermes", "max_assistant_turns": None},
            }
        }
    )
    wrap = SimpleNamespace
    return CodeGymAgentLoop(
        wrap(config=config),
        server,
        TOKENIZER,
        None,
        dataset_config=wrap(config=Conf()),
        target=target,
        **kwargs,
    )


def observed(model: ScriptedModel, recorded: dict[str, Any]) -> None:
    """Each model turn after the first saw the recorded observation of the call before it."""
    for k, (_, observation) in enumerate(recorded["steps"][:-1]):
        expected = f"<tool_response>\n{observation}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        assert model.prompts[k + 1].endswith(expected), k


@pytest.mark.jail
async def test_a_row_an_infrastructure_fault_ended_has_no_token_to_train_on(
    library: Path, worker: CodegymServer, verl_stand_ins: dict[str, Any]
) -> None:
    """The runtime stops for good after two steps; the third step's wait (1 s here) runs out. The
    row verl gets keeps the model's turns (for verl's logs) with a mask of zeros: no gradient, and
    the codegym_* estimators leave it out of its group (tests/test_verl_real.py)."""
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    server = start_runtime(library, worker)
    stopped = False

    def before(turn: int) -> None:
        nonlocal stopped
        if turn == 3:
            assert server.stop() == 0
            stopped = True

    model = ScriptedModel(oracle_turns(recorded))
    try:
        loop = stand_in_loop(server.address, ScriptedServer(model, before), timeout_s=2, outage_wait_s=1)
        output = await loop.run(
            {}, ability=ability(recorded), raw_prompt=[{"role": "user", "content": "Go."}]
        )
    finally:
        if not stopped:
            server.stop()
    fields = output.extra_fields
    assert fields["codegym_infrastructure_failure"] is True and fields["codegym_stop"] == "infrastructure"
    assert fields["codegym_failure_reason"].startswith("Step: UNAVAILABLE"), fields["codegym_failure_reason"]
    assert (output.reward_score, fields["codegym_steps"]) == (0.0, 2)
    assert len(output.response_ids) == len(output.response_mask) > 0
    assert set(output.response_mask) == {0}
    text = TOKENIZER.decode(output.response_ids)
    assert text.count("<tool_response>") == 2 and text.endswith(oracle_turns(recorded)[2])
    assert "unavailable" not in text.lower()


@pytest.mark.jail
async def test_an_outage_shorter_than_the_wait_costs_no_episode(
    library: Path, worker: CodegymServer, verl_stand_ins: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """The runtime (sessions in Redis) is SIGKILLed after two steps; once the third step says it
    waits out the outage, a runtime comes back on the same address. The episode goes on in its
    session, each turn seeing the recorded observation, and reaches reward 1."""
    caplog.set_level(logging.WARNING, logger="codegym_client.outages")
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    redis = Redis()

    def replica(port: int = 0) -> CodegymServer:
        return CodegymServer(
            [
                "serve",
                "runtime",
                "--port",
                str(port),
                "--library",
                str(library),
                "--sandbox",
                worker.address,
                "--sessions",
                redis.url,
            ]
        )

    first = replica()
    port = int(first.address.rsplit(":", 1)[1])
    killed = threading.Event()
    second: list[CodegymServer] = []
    failures: list[BaseException] = []

    def before(turn: int) -> None:
        if turn == 3:  # two steps played, the third about to be sent
            first.proc.send_signal(signal.SIGKILL)
            assert first.proc.wait(10) == -signal.SIGKILL
            killed.set()

    def come_back() -> None:
        try:
            wait_until(
                lambda: killed.is_set() and "cannot serve it now" in caplog.text, 120, "the step to wait"
            )
            second.append(replica(port))
        except BaseException as exc:  # reported by the test's thread
            failures.append(exc)

    restarter = threading.Thread(target=come_back, daemon=True)
    restarter.start()
    model = ScriptedModel(oracle_turns(recorded))
    try:
        loop = stand_in_loop(first.address, ScriptedServer(model, before), timeout_s=5, outage_wait_s=120)
        output = await loop.run({}, ability=ability(recorded))
        restarter.join(120)
        assert not failures and second
        fields = output.extra_fields
        assert fields["codegym_infrastructure_failure"] is False, fields["codegym_failure_reason"]
        assert (output.reward_score, fields["codegym_stop"]) == (1.0, "done")
        assert fields["codegym_steps"] == len(recorded["steps"])
        observed(model, recorded)
        masked = [t for t, m in zip(output.response_ids, output.response_mask, strict=True) if m]
        assert TOKENIZER.decode(masked) == "".join(oracle_turns(recorded))
        # The third step (index 2) is the one that waited; the session was closed afterwards.
        waited = re.search(r"CodeGym Step 2 of session (\w+)", caplog.text)
        assert waited, caplog.text
        async with AsyncRuntimeClient(second[0].address, timeout_s=30) as client:
            with pytest.raises(SessionNotFound):
                await client.get_session(waited.group(1))
    finally:
        killed.set()
        restarter.join(120)
        first.stop()
        for server in second:
            assert server.stop() == 0
        redis.stop()


@pytest.mark.jail
async def test_the_tool_holds_at_most_max_sessions_and_closes_the_least_recently_used(
    runtime: str, verl_stand_ins: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """`max_sessions: 2` and three episodes: the third's first call closes the first's session in the
    runtime (with a log line); the first episode cannot go on, the others do."""
    from codegym_client.verl import CodeGymTool

    caplog.set_level(logging.WARNING, logger="codegym_client.verl.tool")
    recorded = trajectory("Sample_0001_I__MaxSubarraySumEnv", 27)
    (first_action, first_observation), (second_action, second_observation) = recorded["steps"][:2]
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        schemas = [json.loads(t.json_schema) for t in (await client.get_env(recorded["env_id"])).tools]
        tools = {
            s["function"]["name"]: CodeGymTool({"target": runtime, "max_sessions": 2}, s) for s in schemas
        }
        episodes = [
            SimpleNamespace(
                request_id=f"episode-{name}-{id(tools)}",
                tools_kwargs={"any": {"create_kwargs": {"ability": ability(recorded)}}},
            )
            for name in "abc"
        ]
        sessions = []
        for agent_data in episodes:
            response, _ = await call_as_tool_agent_loop(tools, first_action, agent_data)
            assert response.text == first_observation
            sessions.append(CodeGymTool._sessions[agent_data.request_id].session_id)
        assert list(CodeGymTool._sessions) == [e.request_id for e in episodes[1:]]
        with pytest.raises(SessionNotFound):
            await client.get_session(sessions[0])
        assert [(await client.get_session(s)).step_index for s in sessions[1:]] == [1, 1]
        assert f"closing session {sessions[0]} of episode {episodes[0].request_id}" in caplog.text
        with pytest.raises(InfrastructureFailure, match="max_sessions=2"):
            await call_as_tool_agent_loop(tools, second_action, episodes[0])
        response, _ = await call_as_tool_agent_loop(tools, second_action, episodes[1])
        assert response.text == second_observation
        # b was used last now: a fourth episode would close c's session first.
        assert list(CodeGymTool._sessions) == [episodes[2].request_id, episodes[1].request_id]
        await next(iter(tools.values())).close_all()
        assert not CodeGymTool._sessions
        for session_id in sessions[1:]:
            with pytest.raises(SessionNotFound):
                await client.get_session(session_id)
