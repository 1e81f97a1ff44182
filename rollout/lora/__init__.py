"""The LoRA room: adapters (``adapters``: ``LoraAdapter``, loading from peft folders or tensors) and their slots
(``slots``: ``LoraSlots``, the per-token delta that forward hooks add inside the engine's step, and only there).

May import the ground modules only (``rollout.checks``, ``config``, ``sampling_params``, ``stop_strings``,
``requests``); the engine's worker and top, the manager, the fleet and serve import this room through this face.
"""

from rollout.lora.adapters import LoraAdapter, adapter_state_dict, lora_module_name
from rollout.lora.slots import LoadedAdapter, LoraHook, LoraSlots

__all__ = ["LoadedAdapter", "LoraAdapter", "LoraHook", "LoraSlots", "adapter_state_dict", "lora_module_name"]
