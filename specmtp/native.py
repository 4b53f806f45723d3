"""The row-invariant attention kernel in C (attention.c), compiled here once per machine.

invariant.py needs every query row's attention to get the bits a one-token step gives it.
In torch that means one pair of products per row and layer, whose calls cost more than
their arithmetic: about 4 ms of a 56 ms bfloat16 step of the default model, and another
ms or so per extra row of a verify pass (docs/exact-bfloat16.md). attention.c computes all
rows of a layer in one call, each (query, key) pair by the same chain of operations, so the
bits still do not depend on the other rows, and reads the shared keys once.

The kernel is compiled with the C compiler found here (`$CC`, else `cc` or `gcc`), with
-march=native when the compiler takes it, into $SPECMTP_CACHE/native/, named by a hash of
the source, the flags, the compiler and the CPU, so a cache shared by several machines
never hands one another's build. Without a compiler, or with SPECMTP_NATIVE=0, attention
stays in torch: slower, exact all the same. Within a process one path serves every call, so
plain decoding and verification always agree.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("attention.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-fno-fast-math")
ENABLE = "SPECMTP_NATIVE"  # "0": attention in torch, no compiling
# What attention.c takes (its LANES and MAX_D): head size a multiple of KERNEL_LANES, at
# most KERNEL_MAX_D; at most KERNEL_LANES query heads per key head; these key dtypes.
KERNEL_LANES, KERNEL_MAX_D = 16, 256
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
NATIVE, LOOP = "native (attention.c)", "torch, row by row"  # the two paths, in reports
# specmtp_attention's arguments: q, q in bfloat16 (else float32), q's head and row strides,
# scale; k, v, k and v in bfloat16, k's head and row strides, v's; n, heads, kv_heads, d;
# prefix, extra_start, extras, out; out in bfloat16. Flags are ints.
_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
_ARGS += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_int64] * 4
_ARGS += [ctypes.c_int] * 4 + [ctypes.c_void_p] * 4 + [ctypes.c_int]
BUILD_TIMEOUT_S = 120


_refused = False  # set by refuse(): the kernel failed a check, the torch loop for good


def attention_kernel() -> ctypes._CFuncPtr | None:
    """specmtp_attention from the compiled attention.c, or None where there is none."""
    return None if _refused else _compiled()


def refuse() -> None:
    """Use the torch loop from now on in this process (invariant.use_row_invariant calls it
    when a model's forwards disagree with the kernel; it never should)."""
    global _refused
    _refused = True


@cache
def _compiled() -> ctypes._CFuncPtr | None:
    if os.environ.get(ENABLE, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not SOURCE.exists():
        return None
    library = _build(compiler)
    if library is None:
        return None
    function = ctypes.CDLL(str(library)).specmtp_attention
    function.argtypes = _ARGS
    function.restype = ctypes.c_int
    return function


def kernel_name() -> str:
    """What runs the row-invariant attention here where the shapes allow, for reports."""
    return NATIVE if attention_kernel() is not None else LOOP


def _build(compiler: str) -> Path | None:
    """The shared library for this source, compiler and CPU: built once, then reused. None
    when it cannot be built (or the cache cannot be written): attention stays in torch."""
    # imported here: profile imports tree, which imports invariant, which imports this module
    from specmtp.profile import cache_root

    try:
        for flags in ((*FLAGS, "-march=native"), FLAGS):
            target = cache_root() / "native" / f"attention-{_fingerprint(compiler, flags)}.so"
            if target.exists():
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                command = [compiler, *flags, str(SOURCE), "-o", str(built)]
                done = subprocess.run(command, capture_output=True, timeout=BUILD_TIMEOUT_S)
                if done.returncode == 0:
                    os.replace(built, target)  # atomic: a concurrent build writes the same bytes
                    return target
    except (OSError, subprocess.SubprocessError):
        return None
    return None


def _fingerprint(compiler: str, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=BUILD_TIMEOUT_S)
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode() + version.stdout)
    digest.update(_cpu_description().encode())
    return digest.hexdigest()[:16]


def _cpu_description() -> str:
    """The CPU's model and instruction-set flags (Linux), else the machine's name."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.startswith(wanted)}))
