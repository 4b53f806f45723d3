"""specmtp: lossless speculative decoding and multi-token prediction for Hugging Face LMs.

The public names are imported on first use, so that `import specmtp.verification` (or the
CLI's argument checks) does not load the model-loading stack.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Completion": "specmtp.api",
    "SpecGenerator": "specmtp.api",
    "generate": "specmtp.api",
    "GenerationConfig": "specmtp.config",
    "SamplingConfig": "specmtp.config",
    "SpecMTPError": "specmtp.errors",
    "sharing_draft_models": "specmtp.drafter_specs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specmtp' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
