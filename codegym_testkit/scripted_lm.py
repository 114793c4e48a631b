"""A real Hugging Face causal LM that writes a script: what TRL trains in tests/helpers/trl_run.py
(one GRPO step, `make test-trainers`) and bench/soak_trl.py (GRPO steps through a soak).

Its backbone writes, at each position, the one-hot vector of the scripted next token; its LM head
is a trainable linear layer set to +20 on that token and -20 elsewhere. So TRL generates the
script, computes log-probs through its fused LM head and steps the optimizer, as it would with a
real model. The script is codegym_testkit/script.py's `Script`: its `next_tokens(ids, first)` is
the next token at positions `first`.. of `ids` (generation needs only the last position's logits). Imports torch
and transformers: the trainers' venv only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutputWithPast

from codegym_testkit.script import Script


class ScriptConfig(PretrainedConfig):
    model_type = "codegym_script"

    def __init__(self, vocab_size: int = 256, **kwargs: Any) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = vocab_size
        self.max_position_embeddings = 1 << 16
        super().__init__(**kwargs)


class Backbone(nn.Module):
    """Hidden state at each position from `first` on: the one-hot vector of the scripted next
    token (what TRL's fused LM head reads to compute log-probs)."""

    def __init__(self, script: Script, vocab_size: int) -> None:
        super().__init__()
        self.script, self.vocab_size = script, vocab_size

    def forward(self, input_ids: torch.Tensor, first: int = 0, **_: Any) -> BaseModelOutput:
        following = torch.tensor([self.script.next_tokens(row.tolist(), first) for row in input_ids])
        return BaseModelOutput(last_hidden_state=nn.functional.one_hot(following, self.vocab_size).float())


class ScriptedModel(PreTrainedModel, GenerationMixin):
    config_class = ScriptConfig
    base_model_prefix = "model"

    def __init__(self, config: ScriptConfig, script: Script) -> None:
        super().__init__(config)
        self.model = Backbone(script, config.vocab_size)
        self.lm_head = nn.Linear(config.vocab_size, config.vocab_size)
        with torch.no_grad():  # logits: +20 on the scripted token, -20 elsewhere
            self.lm_head.weight.copy_(torch.eye(config.vocab_size) * 40.0)
            self.lm_head.bias.fill_(-20.0)

    def _init_weights(self, module: nn.Module) -> None:
        """Keep the weights set above."""

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, **kwargs: Any) -> dict[str, Any]:
        # No cache: the script reads the whole sequence; only the last position's logits are used.
        return {"input_ids": input_ids, "logits_to_keep": 1}

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,  # left padding: the script reads through it
        logits_to_keep: int = 0,
        **_: Any,
    ) -> CausalLMOutputWithPast:
        first = input_ids.size(1) - logits_to_keep if logits_to_keep else 0
        return CausalLMOutputWithPast(logits=self.lm_head(self.model(input_ids, first).last_hidden_state))
