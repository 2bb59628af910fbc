"""Tensor and expert parallelism across processes on torch.distributed (docs/parallel.md)."""
