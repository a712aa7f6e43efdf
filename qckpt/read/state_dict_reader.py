"""A DCP ``StorageReader`` over metadata it makes itself, in the model's state-dict names.

The HF safetensors reader and the training-checkpoint reader present a dir that DCP did not
write as DCP ``Metadata`` they build from its files; DCP's planning hooks have nothing to do
for them (no per-rank storage plan to agree on): the storage data is the metadata's, the local
and global plans pass through. Each reader adds ``read_metadata`` and ``read_data``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.storage import StorageReader


class StateDictReader(StorageReader):
    """The planning hooks of a reader whose ``Metadata`` is its own (see the module doc)."""

    storage_data: dict[Any, Any]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans
