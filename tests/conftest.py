"""Shared fixtures: tiny random models built from configs, and a per-session model cache."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specmtp import decode_schedules
from specmtp.api import SpecGenerator, eos_token_ids
from specmtp.cli import main
from specmtp.models import LoadedModel, load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tiny models gain nothing from threads, and on a shared 2-core machine a second thread
# makes every small kernel wait on the other process; the default model runs as fast on one.
torch.set_num_threads(1)

TINY_VOCAB = 96
# The shipped drafts' and heads' tests: one chat prompt, greedy, against HF's own decoding.
SHIPPED_PROMPT = "Write a Python function that returns the sum of the squares of a list of numbers."
SHIPPED_NEW_TOKENS = 48


def tiny_model(
    arch: str,
    *,
    seed: int,
    vocab_size: int = TINY_VOCAB,
    context: int = 256,
    head_dim: int | None = None,
) -> PreTrainedModel:
    """A small random causal LM of the given architecture, in eval mode; Llama and Qwen2
    heads are hidden_size / heads = 8 wide unless `head_dim` says otherwise."""
    torch.manual_seed(seed)
    common = {
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
    }
    if arch in ("llama", "qwen2"):
        config_class, model_class = {
            "llama": (LlamaConfig, LlamaForCausalLM),
            "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        }[arch]
        config = config_class(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            max_position_embeddings=context,
            **({} if head_dim is None else {"head_dim": head_dim}),
            **common,
        )
        model = model_class(config)
    elif arch == "gpt2":
        config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=context, **common)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = 0
    return model.eval()


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the default model's tokenizer, as a model directory."""
    tokenizer = load_model("default").tokenizer
    path = tmp_path_factory.mktemp("tiny-target")
    model = tiny_model("llama", seed=0, vocab_size=len(tokenizer), context=512)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def default_model(specmtp_cache: Path) -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def shipped_greedy(default_model: LoadedModel) -> list[int]:
    """HF's greedy answer of the default model to SHIPPED_PROMPT, stopping as ours does."""
    ids = SpecGenerator(default_model).encode(SHIPPED_PROMPT, chat=True)
    eos = eos_token_ids(default_model)
    return hf_greedy(default_model.model, ids, SHIPPED_NEW_TOKENS, eos=eos)


def perturbed_copy(model: PreTrainedModel, *, scale: float, seed: int) -> PreTrainedModel:
    """The same architecture and weights plus Gaussian noise: a partly agreeing draft."""
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(
                torch.randn(param.shape, generator=generator) * scale * param.std().clamp_min(1e-3)
            )
    return copy


@pytest.fixture(scope="session", autouse=True)
def specmtp_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One model cache for the session, unless the environment names one. The default
    model is converted into it here, up front, so no test times or captures that."""
    from specmtp.models import load_model

    with pytest.MonkeyPatch.context() as patch:
        if not os.environ.get("SPECMTP_CACHE"):
            patch.setenv("SPECMTP_CACHE", str(tmp_path_factory.getbasetemp() / "specmtp-cache"))
        load_model("default")
        yield Path(os.environ["SPECMTP_CACHE"])


@pytest.fixture(autouse=True)
def restore_torch_threads() -> Iterator[None]:
    """`--threads` changes the process; keep it from leaking into other tests."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restore_packing() -> Iterator[None]:
    """`--no-packed-weights` changes the process too (specmtp.kernels.set_packing)."""
    from specmtp.kernels import packing_allowed, set_packing

    allowed = packing_allowed()
    yield
    set_packing(allowed)


def hf_greedy(
    model: PreTrainedModel, prompt: list[int], new_tokens: int, *, eos: list[int] | None = None
) -> list[int]:
    """The reference: Hugging Face's own greedy decoding. Without `eos` it runs the whole
    budget (tiny random models have no EOS); with it, it stops as our decoder does."""
    ids = torch.tensor([prompt])
    budget = {"eos_token_id": eos} if eos else {"min_new_tokens": new_tokens}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
        **budget,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def run_cli(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """main() on argv; stdout and stderr as the process would print them."""
    # capfd, not capsys: transformers' log handlers write to the stderr they started with.
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def run_captured(*argv: str) -> tuple[int, str, str]:
    """main() with stdout and stderr captured, for module-scoped fixtures (no capfd)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def no_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, specmtp_cache: Path) -> Path:
    """A cache holding the session's converted models and no tuning profiles."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in specmtp_cache.iterdir():
        if entry.is_dir() and entry.name != "profiles":
            (cache / entry.name).symlink_to(entry, target_is_directory=True)
    monkeypatch.setenv("SPECMTP_CACHE", str(cache))
    return cache


@pytest.fixture
def measurements(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the T(n) measurements the decoder makes, by their max_tokens."""
    calls: list[int] = []
    measure = decode_schedules.measure_verify_costs

    def counting(*args: object, max_tokens: int, **kwargs: object) -> tuple[float, ...]:
        calls.append(max_tokens)
        return measure(*args, max_tokens=max_tokens, **kwargs)

    monkeypatch.setattr(decode_schedules, "measure_verify_costs", counting)
    return calls
