"""Dense projection weights stored input-major.

A weight keeps the checkpoint's logical shape [out, in] (names, loading, refit and export see nothing
different), but its storage is [in, out]: the parameter is the transposed view. `x @ W.t()` then reads
a contiguous [in, out] matrix, which CPU GEMMs run without a transposed operand: measured on the small
config in fp32 (both layouts alternated in one process), decode steps 17-27% faster at 16-64 rows, equal
at one row and in bf16. Loading and refits copy into the view (`copy_` handles any strides), so
addresses stay put; export clones to the contiguous checkpoint layout.

A call the registry's few-row kernel takes (`LINEAR`, bound to the weight at finalize; the rows it takes and
why: `kernels.gemv_cpu.DenseGemv`) runs there; every other call runs `F.linear`, the reference (bf16 calls
through `kernels.bf16_products.linear`: widened to fp32 on a CPU without bf16 matrix units).

Activations may be wider than the weights (`LLM(dtype="bfloat16", activation_dtype="float32")`: bf16
weights at rest, fp32 activations). `compute_weight` is where every product over a resident weight meets
that case: the weight as it is when the dtypes match, else a per-call widened temporary (exact: every bf16
value is an fp32 value), never kept.
"""

import torch
from torch import nn

from dsv4.kernels import bf16_products
from dsv4.kernels.registry import LINEAR, SHARED_INPUT_LINEAR, KernelRegistry, default_registry


def input_major(out_features: int, in_features: int, dtype: torch.dtype, stack: tuple[int, ...] = ()) -> nn.Parameter:
    """A frozen zero weight of logical shape [*stack, out, in] stored as [*stack, in, out]."""
    storage = torch.zeros(*stack, in_features, out_features, dtype=dtype)
    return nn.Parameter(storage.transpose(-1, -2), requires_grad=False)


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in the dtype of the activations it multiplies: itself when they match (the default engine:
    no op), else a widened temporary of the same strides (bf16 weights at rest, fp32 activations: one fp32
    copy of this one matrix per call, freed after it)."""
    return weight if weight.dtype == dtype else weight.to(dtype)


class Linear(nn.Module):
    """y = x W^T, no bias; W [out, in] stored input-major. `kernels`: the model's registry (default: the
    process-wide one)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, kernels: KernelRegistry | None = None):
        super().__init__()
        self.kernels = kernels or default_registry()
        self.weight = input_major(out_features, in_features, dtype)
        self.product = None  # the LINEAR kernel bound to the weight (`bind_kernels`), None: F.linear only

    def bind_kernels(self) -> None:
        """At finalize (`process_weights_after_loading`, every one: a load or refit may follow another): bind
        the registry's few-row kernel to the weight, so what depends only on the weight is decided once and a
        call checks only its rows."""
        self.product = self.kernels.bind(LINEAR, self.weight)

    def forward(self, x: torch.Tensor, decode_rows: bool = False) -> torch.Tensor:
        """decode_rows: x's rows are a decode step's (`StepPlan.single_tokens`), which the few-row kernel takes
        in larger numbers than other rows (`gemv_cpu.MAX_F32_DECODE_ROWS`)."""
        if not torch.compiler.is_compiling():  # a captured graph runs torch (and guards nothing of the kernel)
            product = self.product
            if product is not None and product.supports(x, decode_rows):
                return product(x)
        return bf16_products.linear(x, compute_weight(self.weight, x.dtype))


class SharedInputLinears:
    """Several Linear layers that multiply the same rows: `(x)` -> their outputs, in order. A call the registry's
    SHARED_INPUT_LINEAR kernel takes (bound to the weights at finalize: `bind_kernels`) runs them in one C call,
    the others one Linear call each (the reference, whose results the kernel gives bit for bit). Not a module:
    the Linear layers stay where they are registered (names, loading and refit see nothing of this)."""

    def __init__(self, *linears: Linear):
        self.linears = linears
        self.product = None

    def bind_kernels(self, kernels: KernelRegistry) -> None:
        """At finalize, after a load or refit (the kernel reads the weights' addresses, which stay put)."""
        self.product = kernels.bind(SHARED_INPUT_LINEAR, *(linear.weight for linear in self.linears))

    def __call__(self, x: torch.Tensor, decode_rows: bool = False) -> list[torch.Tensor]:
        if not torch.compiler.is_compiling():
            product = self.product
            if product is not None and product.supports(x, decode_rows):
                return product(x)
        return [linear(x, decode_rows) for linear in self.linears]
