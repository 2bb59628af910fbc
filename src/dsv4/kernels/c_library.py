"""Build a kernel's C source (a `.c` file shipped next to it) into a cached shared library and load it.

The system C compiler compiles it at first use into a per-user cache directory ($DSV4_KERNEL_CACHE, else
~/.cache/dsv4/kernels), keyed by the source and the headers beside it, the flags and the compiler, so a
changed source or toolchain rebuilds and an unchanged one loads in milliseconds.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

# Flags every kernel library is built with: optimised, position-independent, IEEE arithmetic (the kernels
# are tested against the torch reference formulas at fp32 rounding).
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-fast-math")
# The -march target of a library built for this CPU: its binary depends on `cpu_features()`.
NATIVE = "native"
# Compiler messages kept in an error (the first lines say what failed).
MAX_ERROR_CHARS = 500


def cache_dir() -> Path:
    override = os.environ.get("DSV4_KERNEL_CACHE")
    return Path(override) if override else Path.home() / ".cache" / "dsv4" / "kernels"


def cpu_features() -> str:
    """This CPU's feature flags (what -march=native compiles for): the machine key of a native build."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_library(source: Path, flags: tuple[str, ...] = (), machine_key: str = "") -> ctypes.CDLL:
    """Compile `source` (once per version) and load it.

    Args:
        source: the .c file; headers it includes sit in its directory.
        flags: compiler flags beyond BASE_FLAGS (e.g. -march, -pthread).
        machine_key: what else the binary depends on (e.g. this CPU's features for -march=native).

    Returns:
        The loaded library (the caller sets its functions' argument types).

    Raises:
        RuntimeError: no C compiler, or the compilation failed (its message included).
        OSError: the library could not be written or loaded.
    """
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler on PATH (tried $CC, cc, gcc)")
    all_flags = (*BASE_FLAGS, *flags, f"-I{source.parent}")
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    key = "\n".join([source.read_text(), *headers, *all_flags[:-1], compiler,
                     str(os.stat(compiler).st_mtime_ns), machine_key])
    target = cache_dir() / f"{source.stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *all_flags, str(source), "-o", str(built), "-lm"],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:MAX_ERROR_CHARS]}")
            os.replace(built, target)  # atomic: concurrent processes never load a half-written file
    return ctypes.CDLL(str(target))
