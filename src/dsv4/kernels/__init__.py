"""Fast paths behind a registry with capability checks; the torch reference is always the fallback."""

from dsv4.kernels.registry import default_registry, describe_backends

__all__ = ["default_registry", "describe_backends"]
