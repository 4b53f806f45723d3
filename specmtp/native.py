"""The C kernels (attention.c, int8.c, int4.c, lean.c, amx.c), compiled here once per machine.

invariant.py needs every query row's attention to get the bits a one-token step gives it.
In torch that means one pair of products per row and layer, whose calls cost more than
their arithmetic: about 4 ms of a 56 ms bfloat16 step of the default model, and another
ms or so per extra row of a verify pass (docs/exact-bfloat16.md). attention.c computes all
rows of a layer in one call, each (query, key) pair by the same chain of operations, so the
bits still do not depend on the other rows, and reads the shared keys once.

int8.c is the product of `#int8` drafters (int8.py): with AVX512-VNNI it reads a draft's
int8 weights faster than fbgemm's dynamic product (18-53% less time for the Qwen2.5 0.5B
draft's matrices, 1-8 rows, 2 threads, weights out of cache), OpenMP-threaded. torch's own
OpenMP runtime (libgomp.so.1, loaded with torch) serves it, so both share one thread pool.
lean.c holds the rotary, norm and activation steps of lean.py's draft forward, and its
layers in one call (lean_layers.py). amx.c is a row-invariant bfloat16 product on AMX tiles
for the target's verify passes (amx.py).

A kernel is compiled with the C compiler found here (`$CC`, else `cc` or `gcc`), with
-march=native when the compiler takes it, into $SPECMTP_CACHE/native/, named by a hash of
the source, the flags, the compiler and the CPU, so a cache shared by several machines
never hands one another's build. Without a compiler, or with SPECMTP_NATIVE=0, attention
stays in torch (slower, exact all the same) and int8 products in fbgemm. Within a process
one path serves every call, so plain decoding and verification always agree.
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
from typing import NamedTuple

import torch

SOURCE = Path(__file__).with_name("attention.c")
INT8_SOURCE = Path(__file__).with_name("int8.c")
LEAN_SOURCE = Path(__file__).with_name("lean.c")
INT4_SOURCE = Path(__file__).with_name("int4.c")
AMX_SOURCE = Path(__file__).with_name("amx.c")
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c11", "-ffp-contract=off", "-fno-fast-math")
ENABLE = "SPECMTP_NATIVE"  # "0": attention in torch, int8 products in fbgemm, no compiling
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
# specmtp_int8_linear's arguments: x, x in bfloat16 (else float32), m, k; packed, n,
# scale, wsum, bias (or NULL); y, threads
_INT8_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_INT8_ARGS += [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int]
# lean.c's specmtp_split_rotary: qkv, n, heads, kv_heads, d, cos, sin, q, k, v, k and v in
# bfloat16 (else float32); specmtp_add_rms_norm: x, delta (or NULL), n, hidden, weight, eps, out
_ROTARY_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
_ROTARY_ARGS += [ctypes.c_void_p] * 5 + [ctypes.c_int]
_NORM_ARGS = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_NORM_ARGS += [ctypes.c_float, ctypes.c_void_p]
_SILU_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
# specmtp_top_k: x, n, V, k, values, indices, lse (or NULL)
_TOP_K_ARGS = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
# specmtp_lean_layers: layers, their count, specmtp_attention, step, x, h (lean_layers.py)
_LAYERS_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
_LAYERS_ARGS += [ctypes.c_void_p, ctypes.c_void_p]
# specmtp_int4_linear's arguments: x, x in bfloat16, m, k; records, n, C, bias (or NULL);
# y, threads
_INT4_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_INT4_ARGS += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
# specmtp_amx_linear's arguments: x, m, k; packed, n, bias (or NULL); y, threads
_AMX_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
_AMX_ARGS += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
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
    library = _library(SOURCE, FLAGS)
    if library is None:
        return None
    function = library.specmtp_attention
    function.argtypes = _ARGS
    function.restype = ctypes.c_int
    return function


@cache
def int8_kernel() -> ctypes._CFuncPtr | None:
    """specmtp_int8_linear from the compiled int8.c, or None where there is none: no
    compiler or no OpenMP, SPECMTP_NATIVE=0, or a CPU without AVX512-VNNI (the C compiler
    does not define __AVX512VNNI__ for it)."""
    library = _library(INT8_SOURCE, (*FLAGS, "-fopenmp"))
    if library is None or not library.specmtp_int8_vnni():
        return None
    function = library.specmtp_int8_linear
    function.argtypes = _INT8_ARGS
    function.restype = ctypes.c_int
    return function


@cache
def int4_kernel() -> ctypes._CFuncPtr | None:
    """specmtp_int4_linear from the compiled int4.c (`#int4` drafts, int4.py), or None where
    there is none: as int8_kernel."""
    library = _library(INT4_SOURCE, (*FLAGS, "-fopenmp"))
    if library is None or not library.specmtp_int4_vnni():
        return None
    function = library.specmtp_int4_linear
    function.argtypes = _INT4_ARGS
    function.restype = ctypes.c_int
    return function


class AmxKernels(NamedTuple):
    """amx.c's functions (amx.py)."""

    packed_values: ctypes._CFuncPtr  # specmtp_amx_packed_values(n, k)
    pack: ctypes._CFuncPtr  # specmtp_amx_pack(w, n, k, stride, packed)
    linear: ctypes._CFuncPtr  # specmtp_amx_linear(x, m, k, packed, n, bias, y, threads)


@cache
def amx_kernels() -> AmxKernels | None:
    """The compiled amx.c, or None where it cannot run: no compiler or no OpenMP,
    SPECMTP_NATIVE=0, a CPU without AMX (the compiler does not define __AMX_BF16__ for it)
    or a kernel that does not grant this process the tiles."""
    library = _library(AMX_SOURCE, (*FLAGS, "-fopenmp"))
    if library is None or not library.specmtp_amx_ready():
        return None
    kernels = AmxKernels(
        library.specmtp_amx_packed_values, library.specmtp_amx_pack, library.specmtp_amx_linear
    )
    kernels.packed_values.argtypes = [ctypes.c_int64] * 2
    kernels.packed_values.restype = ctypes.c_int64
    kernels.pack.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    kernels.pack.restype = None
    kernels.linear.argtypes = _AMX_ARGS
    kernels.linear.restype = ctypes.c_int
    return kernels


class LeanKernels(NamedTuple):
    """lean.c's steps (lean.py's draft forward)."""

    rotary: ctypes._CFuncPtr  # specmtp_split_rotary
    norm: ctypes._CFuncPtr  # specmtp_add_rms_norm
    silu_mul: ctypes._CFuncPtr  # specmtp_silu_mul
    layers: ctypes._CFuncPtr  # specmtp_lean_layers: every layer of a step in one call
    top_k: ctypes._CFuncPtr  # specmtp_top_k: rows' largest values and log-sum-exp


@cache
def lean_kernels() -> LeanKernels | None:
    """The compiled lean.c's steps, or None where there are none (no compiler, or
    SPECMTP_NATIVE=0)."""
    library = _library(LEAN_SOURCE, FLAGS)
    if library is None:
        return None
    kernels = LeanKernels(
        library.specmtp_split_rotary, library.specmtp_add_rms_norm, library.specmtp_silu_mul,
        library.specmtp_lean_layers, library.specmtp_top_k,
    )  # fmt: skip
    arguments = (_ROTARY_ARGS, _NORM_ARGS, _SILU_ARGS, _LAYERS_ARGS, _TOP_K_ARGS)
    results = (None, None, None, ctypes.c_int, None)
    for function, types, result in zip(kernels, arguments, results, strict=True):
        function.argtypes, function.restype = types, result
    return kernels


def _library(source: Path, flags: tuple[str, ...]) -> ctypes.CDLL | None:
    if os.environ.get(ENABLE, "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None or not source.exists():
        return None
    library = _build(compiler, source, flags)
    return None if library is None else ctypes.CDLL(str(library))


def kernel_name() -> str:
    """What runs the row-invariant attention here where the shapes allow, for reports."""
    return NATIVE if attention_kernel() is not None else LOOP


def _build(compiler: str, source: Path, base_flags: tuple[str, ...]) -> Path | None:
    """The shared library for this source, compiler and CPU: built once, then reused. None
    when it cannot be built (or the cache cannot be written): the torch path stays."""
    # imported here: profile imports tree, which imports invariant, which imports this module
    from specmtp.profile import cache_root

    try:
        for flags in ((*base_flags, "-march=native"), base_flags):
            name = f"{source.stem}-{_fingerprint(compiler, source, flags)}.so"
            target = cache_root() / "native" / name
            if target.exists():
                return target
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
                built = Path(scratch) / target.name
                command = [compiler, *flags, str(source), "-o", str(built)]
                done = subprocess.run(command, capture_output=True, timeout=BUILD_TIMEOUT_S)
                if done.returncode == 0:
                    os.replace(built, target)  # atomic: a concurrent build writes the same bytes
                    return target
    except (OSError, subprocess.SubprocessError):
        return None
    return None


def _fingerprint(compiler: str, source: Path, flags: tuple[str, ...]) -> str:
    version = subprocess.run([compiler, "--version"], capture_output=True, timeout=BUILD_TIMEOUT_S)
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode() + version.stdout)
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
