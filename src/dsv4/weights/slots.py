"""Where each native checkpoint tensor lands: native name -> (model, resident parameter, expert index).

Built once from the models themselves, so the table can never disagree with what was allocated.
"""

import re
from dataclasses import dataclass

import torch

from dsv4.model.derived import TopLevelModel

_STACKED_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<w>w[123])$")
_EXPERT_SCALE_PARAM = re.compile(r"^.*\.experts\.w[123]_scale$")


@dataclass(frozen=True)
class Slot:
    native: str  # native weight name, e.g. "layers.2.ffn.experts.5.w1.weight"
    role: str  # which top-level model: "target" | "mtp" | "dspark"
    param: str  # parameter name inside that model
    expert: int | None = None  # index into a stacked expert parameter

    @property
    def is_expert(self) -> bool:
        return self.expert is not None


class SlotTable:
    """All slots of a set of top-level models (the target and any drafters)."""

    def __init__(self, models: dict[str, TopLevelModel]):
        self.models = models
        self._slots: dict[str, Slot] = {}
        for role, model in models.items():
            for param_name, param in model.named_parameters():
                if _EXPERT_SCALE_PARAM.match(param_name):
                    continue  # written together with its weight
                if match := _STACKED_EXPERT_PARAM.match(param_name):
                    for e in range(param.shape[0]):
                        native = model.native_name(f"{match['prefix']}.{e}.{match['w']}.weight")
                        self._add(Slot(native=native, role=role, param=param_name, expert=e))
                else:
                    self._add(Slot(native=model.native_name(param_name), role=role, param=param_name))

    def _add(self, slot: Slot) -> None:
        if slot.native in self._slots:
            raise RuntimeError(f"two resident tensors claim the native name {slot.native}")
        self._slots[slot.native] = slot

    def get(self, native: str) -> Slot | None:
        return self._slots.get(native)

    def __iter__(self):
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def names(self, role: str | None = None) -> set[str]:
        return {s.native for s in self._slots.values() if role is None or s.role == role}

    def param(self, slot: Slot) -> torch.Tensor:
        return self.models[slot.role].get_parameter(slot.param)

    def scale_param(self, slot: Slot) -> torch.Tensor | None:
        model = self.models[slot.role]
        name = f"{slot.param}_scale"
        try:
            return model.get_parameter(name)
        except AttributeError:
            return None

    def expert_format(self, slot: Slot) -> str:
        experts = self.models[slot.role].get_submodule(slot.param.rsplit(".", 1)[0])
        return experts.format
