"""The verl adapter (`codegym_client.verl`) against a real runtime and sandbox worker serving the sample
library. The episode driver (`run_episode`, what `CodeGymAgentLoop.run` plays) runs with a scripted
`generate` replaying recorded oracle trajectories (examples/trajectories.jsonl) as hermes tool calls,
the format verl's `HermesToolParser` reads, and a byte-level tokenizer with a ChatML template written
here. No verl, no torch; the tests of verl's own classes skip when verl cannot be imported."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from codegym.library import Library
from codegym_cli.oracle import read_trajectories
from codegym_client import AsyncRuntimeClient, EnvNotFound, SessionNotFound
from codegym_client.verl import Episode, run_episode, text_tool_parser, tool_config, visible_text
from tests.conftest import ENV_DIR, EXAMPLES
from tests.helpers.servers import ServerProcess

TRAJECTORIES = read_trajectories(EXAMPLES / "trajectories.jsonl")
HAVE_VERL = importlib.util.find_spec("verl") is not None
NO_VERL = "verl is not installed (it pulls torch): its AgentLoopBase/BaseTool subclasses are not run here"
if not HAVE_VERL and os.environ.get("CODEGYM_TESTS_REQUIRE_VERL") == "1":  # `make test-verl`
    raise RuntimeError("CODEGYM_TESTS_REQUIRE_VERL=1 but verl cannot be imported")


def ability(trajectory: dict[str, Any]) -> str:
    return f"codegym_v1@{trajectory['env_id']}@{json.dumps(trajectory['config'])}"


def trajectory(env_id: str, steps: int | None = None) -> dict[str, Any]:
    """The first recorded oracle trajectory of `env_id` (with `steps` steps, when given)."""
    return next(
        t for t in TRAJECTORIES if t["env_id"] == env_id and (steps is None or len(t["steps"]) == steps)
    )


class ByteTokenizer:
    """A tokenizer as verl uses one: one token per byte, a ChatML chat template with a system prompt
    and the tools in it (as Qwen's), tool messages as `<tool_response>` user turns."""

    pad_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        text = "<|im_start|>system\nYou are a helpful assistant."
        if tools:
            text += "\n<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>"
        text += "<|im_end|>\n"
        for message in conversation:
            if message["role"] == "tool":
                text += (
                    f"<|im_start|>user\n<tool_response>\n{message['content']}\n</tool_response><|im_end|>\n"
                )
            else:
                text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text


TOKENIZER = ByteTokenizer()


def hermes(action: str) -> str:
    call = json.loads(action)
    return f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': call['parameters']})}\n</tool_call>"


class ScriptedModel:
    """`generate` replaying turns (text) in order, recording every prompt it was given."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)
        self.prompts: list[str] = []

    async def __call__(self, prompt_ids: list[int]) -> Any:
        self.prompts.append(TOKENIZER.decode(prompt_ids))
        text = self.turns.pop(0) if self.turns else "I give up.<|im_end|>"
        return SimpleNamespace(token_ids=TOKENIZER.encode(text), log_probs=None)


def oracle_turns(recorded: dict[str, Any]) -> list[str]:
    return [
        f"<think>Next: {action[:20]}</think>\n{hermes(action)}<|im_end|>" for action, _ in recorded["steps"]
    ]


def model_text(episode: Episode) -> str:
    return TOKENIZER.decode(
        [t for t, m in zip(episode.response_ids, episode.response_mask, strict=True) if m]
    )


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("library") / "library.db"
    with Library(path) as lib:
        lib.import_paths([ENV_DIR, EXAMPLES / "tasks.jsonl"])
    return path


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    process = ServerProcess(["serve", "sandbox", "--port", "0", "--jails", "1"])
    try:
        yield process
    finally:
        assert process.stop() == 0


def start_runtime(library: Path, worker: ServerProcess) -> ServerProcess:
    return ServerProcess(
        ["serve", "runtime", "--port", "0", "--library", str(library), "--sandbox", worker.address]
    )


@pytest.fixture(scope="module")
def runtime(library: Path, worker: ServerProcess) -> Iterator[str]:
    server = start_runtime(library, worker)
    try:
        yield server.address
    finally:
        assert server.stop() == 0


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


async def test_a_row_the_runtime_does_not_know_raises(runtime: str) -> None:
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        with pytest.raises(EnvNotFound):  # the data is wrong: not an outage, not an episode
            await run_episode(
                client,
                'codegym_v1@Nope_0000_I__NoEnv@{"a": 1}',
                tokenizer=TOKENIZER,
                generate=ScriptedModel([]),
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_runtime_ends_the_episode_flagged_without_an_observation(
    library: Path, worker: ServerProcess
) -> None:
    # Unreachable from the start: no session, no model turn, the flag.
    async with AsyncRuntimeClient(f"127.0.0.1:{free_port()}", timeout_s=2, attempts=2) as client:
        model = ScriptedModel(["never"])
        episode = await run_episode(client, ability(TRAJECTORIES[0]), tokenizer=TOKENIZER, generate=model)
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
            episode = await run_episode(client, ability(recorded), tokenizer=TOKENIZER, generate=generate)
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


@pytest.mark.skipif(not HAVE_VERL, reason=NO_VERL)
async def test_verl_agent_loop_subclass_runs_with_a_fake_server_manager(
    runtime: str,
) -> None:  # pragma: no cover
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, DictConfigWrap, _agent_loop_registry

    from codegym_client.verl import AGENT_NAME, CodeGymAgentLoop

    assert _agent_loop_registry[AGENT_NAME]["_target_"] == "codegym_client.verl.agent_loop.CodeGymAgentLoop"
    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    model = ScriptedModel(oracle_turns(recorded))

    class FakeServerManager:
        async def generate(
            self, request_id: str, *, prompt_ids: list[int], sampling_params: Any, **_: Any
        ) -> Any:
            return await model(prompt_ids)

    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "response_length": 65536,
                    "multi_turn": {
                        "format": "hermes",
                        "max_assistant_turns": None,
                        "max_tool_response_length": 256,
                    },
                }
            }
        }
    )
    loop = CodeGymAgentLoop(
        DictConfigWrap(config),
        FakeServerManager(),
        TOKENIZER,
        None,
        dataset_cls=None,
        dataset_config=DictConfigWrap(OmegaConf.create({})),
        target=runtime,
    )
    output = await loop.run({}, ability=ability(recorded), raw_prompt=[{"role": "user", "content": "Go."}])
    assert isinstance(output, AgentLoopOutput)
    assert output.reward_score == 1.0 and output.extra_fields["codegym_infrastructure_failure"] is False
    assert len(output.response_ids) == len(output.response_mask)


@pytest.mark.skipif(not HAVE_VERL, reason=NO_VERL)
async def test_verl_tool_keeps_one_session_per_request_id_across_tool_instances(
    runtime: str,
) -> None:  # pragma: no cover
    from verl.tools.schemas import OpenAIFunctionToolSchema

    from codegym_client.verl import CodeGymTool

    recorded = trajectory("Sample_0006_I__ArrayGcdEnv")
    async with AsyncRuntimeClient(runtime, timeout_s=30) as client:
        schemas = [json.loads(t.json_schema) for t in (await client.get_env(recorded["env_id"])).tools]
    tools = {
        s["function"]["name"]: CodeGymTool({"target": runtime}, OpenAIFunctionToolSchema.model_validate(s))
        for s in schemas
    }
    agent_data = SimpleNamespace(
        request_id="episode-1", tools_kwargs={"Observe": {"create_kwargs": {"ability": ability(recorded)}}}
    )
    rewards = []
    for action, observation in recorded["steps"]:  # as ToolAgentLoop._call_tool: create, execute, release
        call = json.loads(action)
        tool = tools[call["name"]]
        instance_id, _ = await tool.create(create_kwargs={})
        try:
            response, reward, _ = await tool.execute(instance_id, call["parameters"], agent_data=agent_data)
        finally:
            await tool.release(instance_id)
        assert response.text == observation
        rewards.append(reward)
    assert sum(rewards) == 1.0 and rewards[-1] == 1.0
    assert "episode-1" not in CodeGymTool._sessions  # the ended episode's session is closed


# -- verl's interfaces as stand-ins ------------------------------------------------------------------
# Without verl, `agent_loop.py` and `tool.py` run against stand-ins of the few verl names they use,
# written to verl's code (verl/experimental/agent_loop/agent_loop.py, tool_parser.py,
# verl/tools/base_tool.py, schemas.py at verl 0.8): this checks the glue (config reading, run()'s
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

        async def extract_tool_calls(self, ids: list[int]) -> tuple[str, list[Any]]:
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
    )
    before = len(requests)
    output = await down.run({"temperature": 1.0}, **row)
    assert output.extra_fields["codegym_infrastructure_failure"] is True and output.reward_score == 0.0
    assert (output.response_mask, len(requests)) == ([0], before)
    assert TOKENIZER.decode(output.prompt_ids).endswith("Go.<|im_end|>\n<|im_start|>assistant\n")


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
        for action, observation in recorded["steps"]:  # as ToolAgentLoop._call_tool: create, execute, release
            call = json.loads(action)
            tool = tools[call["name"]]
            instance_id, _ = await tool.create(create_kwargs={})
            try:
                response, reward, _ = await tool.execute(
                    instance_id, call["parameters"], agent_data=agent_data
                )
            finally:
                await tool.release(instance_id)
            assert response.text == observation
            rewards.append(reward)
            if len(rewards) == 1:  # one session for the episode, across tool instances
                session_id = CodeGymTool._sessions[agent_data.request_id].session_id
        assert rewards[-1] == 1.0 and sum(rewards) == 1.0
        assert agent_data.request_id not in CodeGymTool._sessions
        with pytest.raises(SessionNotFound):  # the step that ended the episode closed it
            await client.get_session(session_id)
        from codegym_client.verl.tool import EpisodeEnded

        instance_id, _ = await tools["Observe"].create()
        with pytest.raises(EpisodeEnded):
            await tools["Observe"].execute(instance_id, {}, agent_data=agent_data)
