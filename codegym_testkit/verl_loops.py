"""verl's agent loops built as verl 0.9.1's `AgentLoopWorker` builds them, for the tests inside
verl (tests/test_verl_real.py) and the verl soak (bench/soak_verl.py): the part of the trainer
config the loops read, our agent-loop config file registered as the worker registers it, and a
loop instantiated with hydra with verl's wrappers. Imports verl: the trainers' venv only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry

from codegym_client.verl import AGENT_NAME

AGENT_LOOP_YAML = Path(__file__).resolve().parents[1] / "examples" / "verl" / "codegym_agent_loop.yaml"


def trainer_config(response_length: int = 65536, **multi_turn: Any) -> Any:
    """The part of verl's trainer config the agent loops read (verl/trainer/config/rollout);
    `multi_turn` overrides its multi_turn settings."""
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "prompt_length": 4096,
                    "response_length": response_length,
                    "full_determinism": False,
                    "multi_turn": {
                        "format": "hermes",
                        "max_user_turns": None,
                        "max_assistant_turns": None,
                        "max_parallel_calls": 1,
                        "max_tool_response_length": 256,
                        "tool_response_truncate_side": "middle",
                        **multi_turn,
                    },
                }
            },
            "data": {"apply_chat_template_kwargs": {}},
        }
    )


def our_entry(target: str, **settings: Any) -> Any:
    """The README's agent-loop config file with `target` (and `settings`, e.g. `outage_wait_s`),
    registered as `AgentLoopWorker.__init__` registers it."""
    (entry,) = OmegaConf.load(AGENT_LOOP_YAML)
    assert entry.name == AGENT_NAME
    entry.target = target
    for key, value in settings.items():
        entry[key] = value
    _agent_loop_registry[entry.name] = entry
    return _agent_loop_registry[AGENT_NAME]


def instantiate(
    entry: Any,
    config: Any,
    server: Any,
    tokenizer: Any,
    tools: list[Any] | None = None,
    hf_model_type: str = "qwen2",
) -> Any:
    """An agent loop built as `AgentLoopWorker._run_agent_loop` builds one (verl 0.9.1)."""
    return hydra.utils.instantiate(
        config=entry,
        trainer_config=DictConfigWrap(config=config),
        server_manager=server,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=hf_model_type,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(tools or []),
    )
