"""The one lifecycle template every load format follows: build -> load -> check -> finalize -> READY.

    models = build_models(cfg, ...)          allocate every resident tensor once, in runtime layout
    load (checkpoint | dummy | tensors)      WeightWriter: map, pair, validate, convert, copy_ in place
    check_complete                           every expected tensor written (dummy included)
    finalize                                 process_weights_after_loading(): target, then drafters

Any failure raises before the models are returned, so no half-loaded model ever escapes. A checkpoint
load streams tensors from the files straight into resident storage (those kept as they are read into it
with one kernel copy, the rest converted from mapped views; `checkpoint.py`), with the files' disk reads
issued from before the build on (`readahead.py`), and shows a progress bar on a terminal when it takes
more than a second.
"""

import contextlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dsv4.config import DENSE, EXPERT_FORMATS, ModelConfig
from dsv4.errors import CheckpointError, ConfigError
from dsv4.kernels.registry import KernelRegistry
from dsv4.lazy_memory import ArenaAllocation, WeightArena
from dsv4.model.deepseek_v4 import DeepseekV4
from dsv4.model.derived import TopLevelModel
from dsv4.parallel.state import SINGLE, ParallelState, check_divisible
from dsv4.weights.checkpoint import CheckpointDir
from dsv4.weights.collection import collection_paused
from dsv4.weights.convert import QuantLayout
from dsv4.weights.dummy import dummy_tensors
from dsv4.weights.routes import RouteTable
from dsv4.weights.shards import ShardSlicer
from dsv4.weights.slots import SlotTable, parameter_addresses
from dsv4.weights.writer import StagingBuffers, WeightWriter

LOAD_FORMATS = ("auto", "safetensors", "dummy")
DRAFTERS = ("mtp", "dspark")
TARGET = "target"
# A load shows progress only past this many seconds: short loads stay silent.
PROGRESS_DELAY_S = 1.0


@dataclass
class LoadedModels:
    """The target and its drafters, READY, plus the writer-facing view of all their tensors."""

    config: ModelConfig
    models: dict[str, TopLevelModel]
    layout: QuantLayout
    expert_format: str
    load_format: str
    ignored: set[str] = field(default_factory=set)
    parallel: ParallelState = SINGLE  # this rank's share of a tensor / expert parallel group
    _routes: RouteTable | None = field(default=None, init=False, repr=False, compare=False)
    # Atomic updates' staging buffers, kept from one update to the next (see `StagingBuffers`).
    staging: StagingBuffers = field(default_factory=StagingBuffers, init=False, repr=False, compare=False)

    @property
    def target(self) -> DeepseekV4:
        return self.models[TARGET]  # type: ignore[return-value]

    def routes(self, addresses: dict[tuple[str, str], int] | None = None) -> RouteTable:
        """The models' name plan and destinations, built once and kept while no parameter has moved (a
        moved parameter would leave the plan's views pointing at storage the model no longer reads).

        Args:
            addresses: the current (role, name) -> data_ptr of every parameter (extra entries are ignored),
                when the caller has just taken them; otherwise they are taken here.
        """
        if self._routes is None:  # the first plan (a load's): nothing to compare, so no walk of the parameters
            self._routes = RouteTable(SlotTable(self.models))
            return self._routes
        if addresses is None:
            addresses = parameter_addresses(self.models)
        if not self._routes.table.addresses.items() <= addresses.items():
            self._routes = RouteTable(SlotTable(self.models))
            self.staging.clear()  # buffers shaped after destinations the new plan no longer holds
        return self._routes

    def shard_slicer(self, routes: RouteTable) -> ShardSlicer | None:
        """What cuts this rank's shard out of incoming full tensors (None in one process)."""
        if not self.parallel.is_parallel:
            return None
        return ShardSlicer(routes, self.layout, self.parallel, self.config.n_routed_experts)

    def slot_table(self) -> SlotTable:
        return self.routes().table

    def finalize(self) -> None:
        """Finalize the target first: drafters alias its embedding and head."""
        for role in (TARGET, *DRAFTERS):
            if role in self.models:
                self.models[role].process_weights_after_loading()


def resolve_expert_format(cfg: ModelConfig, override: str | None) -> str:
    if override is not None:
        if override not in EXPERT_FORMATS:
            raise ConfigError(f"expert_dtype: expected one of {EXPERT_FORMATS}, got {override!r}")
        return override
    return cfg.quant.expert_dtype if cfg.quant is not None else DENSE


def quant_layout(cfg: ModelConfig) -> QuantLayout:
    if cfg.quant is None:
        return QuantLayout(fp8_block=(128, 128), fp4_group=32, scale_fmt="ue8m0")
    q = cfg.quant
    return QuantLayout(fp8_block=tuple(q.weight_block_size), fp4_group=q.fp4_group_size, scale_fmt=q.scale_fmt)


def build_models(
    cfg: ModelConfig, expert_format: str, dtype: torch.dtype, device: str, draft: str | None,
    kernels: KernelRegistry | None = None,
    parallel: ParallelState = SINGLE,
    activation_dtype: torch.dtype | None = None,
) -> dict[str, TopLevelModel]:
    """Allocate the target (and the drafter) in runtime layout, this rank's shard of them under `parallel`;
    nothing is READY yet.

    On CPU the tensors the build allocates come from a `WeightArena`: zero without being written, and faulted
    in by huge pages when the load writes them (a zero-filled build would write the whole model once more and
    take a fault per 4 KiB page, which cost several times the load's own copy).

    Args:
        kernels: the registry serving every fast path of the target and its drafter (None: the
            process-wide `default_registry()`; training passes `KernelRegistry(force_reference=True)`,
            since the fast paths have no backward).
        parallel: this rank's share of a tensor / expert parallel group (docs/parallel.md).
        activation_dtype: dtype of the activations and caches (None: `dtype`); the weights stay `dtype` at
            rest whatever it is (docs/rl.md, "bf16 weights, fp32 activations").
    """
    check_divisible(cfg, parallel, expert_format)
    target_device = torch.device(device)
    memory = ArenaAllocation(WeightArena()) if target_device.type == "cpu" else contextlib.nullcontext()
    # torch.device(...) as a context is a Python mode seen by every tensor op of the build (a fifth of its
    # time on CPU): entered only when the factories' default device is not already the target.
    placement = torch.device(device) if target_device != torch.get_default_device() else contextlib.nullcontext()
    with memory, placement:
        target = DeepseekV4(cfg, expert_format, dtype, kernels, parallel, activation_dtype)
        models: dict[str, TopLevelModel] = {TARGET: target}
        if draft is not None:
            from dsv4.model.drafters import build_drafter

            models[draft] = build_drafter(draft, cfg, models[TARGET], expert_format, dtype)
    for model in models.values():
        model.eval()
    return models


def _resolve_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format: expected one of {LOAD_FORMATS}, got {load_format!r}")
    if load_format == "auto":
        return "safetensors"
    return load_format


def load_models(
    path: str | Path,
    *,
    load_format: str = "auto",
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    draft: str | None = None,
    expert_dtype: str | None = None,
    seed: int = 0,
    kernels: KernelRegistry | None = None,
    parallel: ParallelState = SINGLE,
    activation_dtype: torch.dtype | None = None,
) -> LoadedModels:
    """Build, load and finalize a checkpoint directory's models (`kernels`, `activation_dtype`: see
    `build_models`; under `parallel`, this rank's shard of them: only its part of each tensor is read from the
    files; dummy values are seeded per rank)."""
    with collection_paused():  # thousands of objects made, none of them garbage: `collection.py`
        return _load_models(Path(path), load_format, dtype, device, draft, expert_dtype, seed, kernels, parallel,
                            activation_dtype)


def _load_models(
    path: Path, load_format: str, dtype: torch.dtype, device: str, draft: str | None, expert_dtype: str | None,
    seed: int, kernels: KernelRegistry | None, parallel: ParallelState, activation_dtype: torch.dtype | None,
) -> LoadedModels:
    cfg = ModelConfig.from_file(path)
    if draft is not None and draft not in DRAFTERS:
        raise ConfigError(f"draft: expected one of {DRAFTERS} or None, got {draft!r}")
    fmt = _resolve_load_format(load_format)
    checkpoint = CheckpointDir(path) if fmt == "safetensors" else None
    if checkpoint is not None and draft == "dspark":
        cfg = cfg.with_checkpoint_names(checkpoint.tensors)  # DSpark's stage count: its mtp.{s} names
    expert_format = resolve_expert_format(cfg, expert_dtype)
    layout = quant_layout(cfg)
    with contextlib.ExitStack() as reads:
        # One process reads every tensor: its disk reads start now, under the build. A rank of a group reads
        # its share, known once its models (and their shard slicer) exist.
        single = checkpoint is not None and not parallel.is_parallel
        ahead = reads.enter_context(checkpoint.readahead()) if single else None
        models = build_models(cfg, expert_format, dtype, device, draft, kernels, parallel, activation_dtype)
        loaded = LoadedModels(cfg, models, layout, expert_format, fmt, parallel=parallel)
        routes = loaded.routes()
        if checkpoint is not None:
            shard = loaded.shard_slicer(routes)
            writer = WeightWriter(routes, layout, error_type=CheckpointError, shard=shard, fresh=True)
            wanted = None if shard is None else (lambda name: not shard.held_elsewhere(name))  # None: every tensor
            if ahead is None:
                ahead = reads.enter_context(checkpoint.readahead(wanted))
            with _progress(checkpoint) as bar, contextlib.closing(
                    checkpoint.iter_tensors(wanted, writer.destination, ahead)) as tensors:
                for name, tensor, origin in tensors:
                    writer.load(name, tensor, origin)
                    bar.update(tensor.numel() * tensor.element_size())
            writer.check_complete(routes.table.names(), f"{path}: incomplete checkpoint")
        else:
            # Dummy values come in local shapes.
            writer = WeightWriter(routes, layout, error_type=CheckpointError, fresh=True)
            for name, tensor in dummy_tensors(routes.table, seed):
                writer.load(name, tensor, "dummy")
            writer.check_complete(routes.table.names(), "dummy load")
    loaded.ignored = writer.ignored
    loaded.finalize()
    return loaded


def _progress(checkpoint: CheckpointDir):
    """A bytes bar over the checkpoint's tensors: drawn only on a terminal, and only once the load has
    taken PROGRESS_DELAY_S (tqdm's `delay`)."""
    from tqdm.auto import tqdm

    total = sum(info.nbytes for info in checkpoint.tensors.values())
    return tqdm(total=total, desc=f"loading {checkpoint.path.name}", unit="B", unit_scale=True,
                delay=PROGRESS_DELAY_S, disable=not sys.stderr.isatty(), leave=False)
