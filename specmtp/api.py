"""The Python API: load a target and a drafter once, then generate or stream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafter_specs import build_drafter, eos_token_ids
from specmtp.drafters import Drafter
from specmtp.errors import SpecMTPError
from specmtp.kernels import apply_kernel_plan
from specmtp.models import LoadedModel, load_model
from specmtp.mtp_drafter import MTPDrafter, dynamic_tree_drafter
from specmtp.profile import Profile, check_profile_weights, weights_fingerprint
from specmtp.specs import TUNED_NODES
from specmtp.stats import GenerationStats
from specmtp.timings import TimingStore


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: list[int]  # the new tokens only
    stats: GenerationStats


def weights_fingerprints(target: LoadedModel, drafter: Drafter | None) -> dict[str, str]:
    """What a tuning profile records of the weights it was measured with."""
    draft = [] if drafter is None else list(drafter.weight_tensors())
    return {
        "target": weights_fingerprint(target.model.parameters()),
        "draft": weights_fingerprint(draft),
    }


def use_profile_tree(profile: Profile, drafter: Drafter | None) -> None:
    """A tree drafter drafts with the tree its profile's budget sweep chose, if any; a
    dynamic tree with the node count its profile's node sweep chose."""
    if profile.nodes is not None:
        use_profile_nodes(profile, drafter)
    tree = profile.token_tree()
    if tree is None:
        return
    if not isinstance(drafter, MTPDrafter) or drafter.tree is None:
        raise SpecMTPError(
            f"profile for {profile.draft!r} holds a token tree, but this draft drafts chains"
        )
    if tree.max_depth > drafter.max_depth:
        raise SpecMTPError(
            f"the profile's tree is {tree.max_depth} deep but the heads predict {drafter.max_depth}"
        )
    drafter.tree = tree


def use_profile_nodes(profile: Profile, drafter: Drafter | None) -> None:
    """`#nodes=auto` takes the profile's node count; a fixed `#nodes=N` must be that count
    (a profile given by path may have been tuned for another)."""
    heads = dynamic_tree_drafter(drafter)
    if heads is None:
        raise SpecMTPError(
            f"profile for {profile.draft!r} holds a node count, but this draft has no dynamic tree"
        )
    if heads.tuned_nodes:
        heads.nodes = profile.nodes
    elif heads.nodes != profile.nodes:
        raise SpecMTPError(
            f"profile for {profile.draft!r} was tuned at {profile.nodes} nodes, "
            f"this draft verifies {heads.nodes}"
        )


class SpecGenerator:
    """A target model and an optional drafter, ready to generate many times.

    >>> gen = SpecGenerator("default", draft="ngram")
    >>> gen.generate("Write a haiku about tea.", chat=True, max_new_tokens=64).text
    """

    def __init__(
        self,
        target: str | LoadedModel = "default",
        *,
        draft: str | Drafter | None = None,
        dtype: torch.dtype = torch.float32,
        profile: Profile | None = None,
    ) -> None:
        self.target = target if isinstance(target, LoadedModel) else load_model(target, dtype=dtype)
        drafter, vocab = build_drafter(draft, self.target, dtype=self.target.model.dtype)
        self.profile = profile
        if profile is not None:  # the kernel plan measured with the profile, if any
            check_profile_weights(profile, weights_fingerprints(self.target, drafter))
            meta = profile.meta
            apply_kernel_plan(self.target.model, meta.get("kernel_plan"), meta.get("kernel_layout"))
            use_profile_tree(profile, drafter)
        if (heads := dynamic_tree_drafter(drafter)) is not None:
            heads.check_nodes_known()  # `#nodes=auto` without a profile: fail before any work
        tokenizer = self.target.tokenizer
        self.decoder = SpecDecoder(
            self.target.model,
            drafter=drafter,
            vocab_size=vocab,
            context_length=self.target.context_length,
            eos_token_ids=eos_token_ids(self.target),
            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            cost_model=None if profile is None else profile.cost_model,
            prior_alphas=() if profile is None else profile.alphas,
            arm_priors={} if profile is None else profile.arm_alphas,
            prior_sampling=None if profile is None else profile.sampling(),
            timings=TimingStore.for_model(self.target.model),
            draft_timings=None
            if drafter is None
            else TimingStore.for_model(self.target.model, drafter=drafter),
        )
        self.last_stats: GenerationStats | None = None
        self.last_tokens: list[int] = []

    def encode(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt; with chat, the tokenizer's chat template is applied."""
        if not isinstance(prompt, str):
            return list(prompt)
        if not prompt.strip():
            raise SpecMTPError("the prompt is empty")
        tokenizer = self.target.tokenizer
        if chat:
            if tokenizer.chat_template is None:
                raise SpecMTPError(f"{self.target.spec} has no chat template")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return tokenizer(text, add_special_tokens=False).input_ids
        return tokenizer(prompt).input_ids

    def config(self, config: GenerationConfig | None = None, **settings: Any) -> GenerationConfig:
        """The request `generate` and `stream` run: `config` (or the defaults) with `settings`
        over it. `gamma` may also be any `specmtp generate --gamma` form (`auto`, `best`, `hf`,
        `guard:N`, `N/M`; gamma_settings), resolved against this generator's profile.

        Without a `config`, a `gamma` or a `schedule`, the γ setting is `default_gamma`'s,
        as in `specmtp generate`: `auto` for a sampled request with a drafter, else a fixed
        γ 4. A `config` given is run as it is."""
        gamma = settings.pop("gamma", None)
        if isinstance(gamma, str):
            settings = {**gamma_settings(gamma, self.profile), **settings}
        elif gamma is not None:
            settings["gamma"] = gamma
        request = make_config(config, **settings)
        if config is not None or gamma is not None or "schedule" in settings:
            return request  # told
        sampled, drafts = not request.sampling.greedy, self.decoder.drafter is not None
        chosen = default_gamma(None, sampled=sampled, drafts=drafts)
        return (
            request if chosen is None else replace(request, **gamma_settings(chosen, self.profile))
        )

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        config: GenerationConfig | None = None,
        **settings: Any,
    ) -> Completion:
        """Generate a completion. `settings` override fields of `config` (or the defaults):
        max_new_tokens, gamma, schedule, seed, stop_strings, temperature, top_k, top_p,
        max_memory_bytes (`config` above says how γ is chosen)."""
        for _ in self.stream(prompt, chat=chat, config=config, **settings):
            pass
        assert self.last_stats is not None
        text = self.target.tokenizer.decode(self.last_tokens, skip_special_tokens=True)
        return Completion(text, self.last_tokens, self.last_stats)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        config: GenerationConfig | None = None,
        **settings: Any,
    ) -> Iterator[str]:
        """Yield the new text as tokens are accepted.

        Afterwards `last_tokens` and `last_stats` hold the run's tokens and statistics.
        """
        config = self.config(config, **settings)
        ids = self.encode(prompt, chat=chat)
        stats = GenerationStats(gamma=config.gamma)
        self.last_stats, self.last_tokens = stats, []
        tokenizer, shown = self.target.tokenizer, ""
        for block in self.decoder.run(ids, config, stats):
            self.last_tokens += block
            text = tokenizer.decode(self.last_tokens, skip_special_tokens=True)
            if text.endswith("\ufffd") and not stats.finish_reason:
                continue  # a multi-byte character is still incomplete
            # Decoding more tokens can, rarely, respell earlier text; the stream then
            # carries on from the new end, and generate() returns the exact final text.
            yield text[len(shown) :]
            shown = text


AUTO_MAX_GAMMA = 8  # the adaptive schedule's largest γ when no profile gives one
GUARD_PREFIX = "guard:"  # `guard:N`: a fixed γ behind the never-slower guard


def reads_profile(draft: str, gamma: str | None) -> bool:
    """Whether a run of `draft` at `gamma` starts from the pair's tuning profile: `--gamma
    auto` and `best` do, and a `#nodes=auto` draft always does (its node count is there)."""
    return gamma in ("auto", "best") or TUNED_NODES in draft


def default_gamma(gamma: str | None, *, sampled: bool, drafts: bool) -> str | None:
    """The γ setting a request runs when the caller gave `gamma` (None: not given): a
    sampled request with a drafter drafts `auto`, others keep the config's fixed γ (None).
    At temperature 0.7 a fixed γ 4 ran 0.73-1.10x of plain decoding (medians by drafter)
    and `auto` 1.14-1.28x (docs/tuning-and-measurement.md, section 25); greedy runs keep
    γ 4 (section 20). `specmtp generate` and SpecGenerator.config both ask here."""
    if gamma is not None or not drafts:
        return gamma
    return "auto" if sampled else None


def gamma_settings(gamma: str | int, profile: Profile | None = None) -> dict[str, Any]:
    """GenerationConfig settings for a draft-length choice: N (fixed), N/M (fixed, N in
    the lookup rounds of an `ngram+SPEC` drafter and M in its model's), `auto` (adaptive,
    up to the profile's largest γ), `best` (the profile's fastest fixed γ, or γ pair),
    `hf` (Hugging Face's +2 / -1 heuristic, starting at the default γ) or `guard:N` /
    `guard:N/M` (fixed, behind the adaptive schedule's never-slower guard)."""
    text = str(gamma)
    guarded = text.startswith(GUARD_PREFIX)
    if guarded:
        text = text.removeprefix(GUARD_PREFIX)  # a number or pair must follow
    elif text == "auto":
        top = profile.max_gamma if profile is not None else AUTO_MAX_GAMMA
        return {"schedule": "adaptive", "gamma": top}
    elif text == "hf":
        return {"schedule": "heuristic"}
    elif text == "best":
        if profile is None:
            raise SpecMTPError("gamma 'best' needs a tuning profile: run `specmtp tune` first")
        best = {"schedule": "fixed", "gamma": profile.best_gamma}
        return best if profile.model_gamma is None else {**best, "model_gamma": profile.model_gamma}
    lookup, slash, model = text.partition("/")
    if not lookup.isdigit() or (slash and not model.isdigit()):
        raise SpecMTPError(
            f"gamma must be a number, N/M, auto, best, hf or guard:N; got {str(gamma)!r}"
        )
    settings: dict[str, Any] = {"schedule": "guarded" if guarded else "fixed", "gamma": int(lookup)}
    if slash:
        settings["model_gamma"] = int(model)
    return settings


def make_config(config: GenerationConfig | None = None, **settings: Any) -> GenerationConfig:
    """A GenerationConfig from an optional base plus flat overrides (sampling included)."""
    config = config or GenerationConfig()
    sampling_keys = {"temperature", "top_k", "top_p"}
    sampling = {k: settings.pop(k) for k in list(settings) if k in sampling_keys}
    if sampling:
        settings["sampling"] = replace(config.sampling, **sampling)
    if "stop_strings" in settings:
        settings["stop_strings"] = tuple(settings["stop_strings"])
    unknown = set(settings) - set(GenerationConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown generation settings: {sorted(unknown)}")
    return replace(config, **settings)


def generate(
    prompt: str,
    *,
    target: str = "default",
    draft: str | None = None,
    chat: bool = False,
    **settings: Any,
) -> Completion:
    """One-shot convenience: load, generate, return text, tokens and statistics."""
    return SpecGenerator(target, draft=draft).generate(prompt, chat=chat, **settings)


__all__ = [
    "Completion",
    "SamplingConfig",
    "SpecGenerator",
    "build_drafter",
    "default_gamma",
    "eos_token_ids",
    "gamma_settings",
    "generate",
]
