"""The PPO trainer's policy and value model as one module: a value head on the policy's trunk, or a
separate critic trunk with its own head (``PPOConfig.value_model``).

One ``nn.Module`` holds both so that ``accelerate.prepare`` wraps them together (DDP syncs the value
head's gradients with the policy's) and one forward returns logits and values. The policy inside is
the user's ``transformers`` model object itself: the rollout manager runs on it, and it is saved with
``save_pretrained`` so that its folder loads with ``AutoModelForCausalLM`` as it is. The value head
(and the critic's trunk) are saved beside it: ``value_head.safetensors`` and ``value_model.json`` in
the same folder, the critic's trunk in ``critic/``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_MODEL_FILE = "value_model.json"
CRITIC_DIR = "critic"


class PolicyWithValue(nn.Module):
    """A causal LM and a value model V(s_t) over the same token positions.

    Args:
        policy: the causal LM (its last hidden state is post-norm, as in every transformers decoder).
        value_model: "head": a linear head on the policy's last hidden state; "critic": a copy of
            the policy's trunk (``policy.base_model``, copied now, before any engine switches the
            policy's attention) with a linear head.

    The head starts at zero weights and bias (V = 0 everywhere), so at the first step the value loss
    sends no gradient into a shared trunk.

    Raises:
        ValueError: an unknown ``value_model``.
    """

    def __init__(self, policy: PreTrainedModel, value_model: str = "head") -> None:
        super().__init__()
        if value_model not in ("head", "critic"):
            raise ValueError(f"value_model must be 'head' or 'critic', got {value_model!r}")
        self.policy = policy
        self.value_model = value_model
        self.critic = copy.deepcopy(policy.base_model) if value_model == "critic" else None
        hidden = policy.config.get_text_config().hidden_size
        weight = next(policy.parameters())
        self.value_head = nn.Linear(hidden, 1, device=weight.device, dtype=weight.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def value_parameters(self) -> list[nn.Parameter]:
        """The parameters the value loss alone trains: the head, and the critic's trunk."""
        params = list(self.value_head.parameters())
        if self.critic is not None:
            params += list(self.critic.parameters())
        return params

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        keep: int,
        with_values: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and values of the last ``keep`` positions.

        Args:
            input_ids, attention_mask, position_ids: int64 [B, T] (``trainers.loss.pad_batch``).
            keep: positions at the end whose logits and values are returned.
            with_values: False skips the value model (logits only).

        Returns:
            logits [B, keep, V] in the model's dtype, and values float32 [B, keep] (None without values).
        """
        head_mode = self.critic is None and with_values
        out = self.policy(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=keep,
            output_hidden_states=head_mode,
        )
        logits = out.logits[:, -keep:]
        if not with_values:
            return logits, None
        if head_mode:
            hidden = out.hidden_states[-1]
        else:
            hidden = self.critic(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        values = self.value_head(hidden[:, -keep:].to(self.value_head.weight.dtype)).squeeze(-1)
        return logits, values.float()

    def save_value(self, directory: str | Path) -> None:
        """Write the value head (and the critic's trunk, in ``critic/``) and ``value_model.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()},
            directory / VALUE_HEAD_FILE,
        )
        if self.critic is not None:
            self.critic.save_pretrained(str(directory / CRITIC_DIR))
        (directory / VALUE_MODEL_FILE).write_text(json.dumps({"value_model": self.value_model}))


def load_policy_with_value(directory: str | Path, policy: PreTrainedModel) -> PolicyWithValue:
    """The value model saved by ``PolicyWithValue.save_value`` in ``directory``, around ``policy``.

    Raises:
        FileNotFoundError: ``directory`` holds no saved value model.
    """
    directory = Path(directory)
    if not (directory / VALUE_MODEL_FILE).is_file():
        raise FileNotFoundError(f"{directory} holds no {VALUE_MODEL_FILE} (not a PPO run's saved model)")
    kind = json.loads((directory / VALUE_MODEL_FILE).read_text())["value_model"]
    module = PolicyWithValue(policy, "head")
    module.value_model = kind
    if kind == "critic":
        weight = next(policy.parameters())
        module.critic = AutoModel.from_pretrained(str(directory / CRITIC_DIR), dtype=weight.dtype).to(weight.device)
    module.value_head.load_state_dict(load_file(str(directory / VALUE_HEAD_FILE)))
    return module
