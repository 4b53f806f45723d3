"""The library's request settings: how `SpecGenerator` chooses γ when the caller does not."""

from __future__ import annotations

from typing import Any

import pytest

from specmtp.api import AUTO_MAX_GAMMA, SpecGenerator
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel


@pytest.fixture(scope="module")
def lookup(default_model: LoadedModel) -> SpecGenerator:
    return SpecGenerator(default_model, draft="ngram")


@pytest.mark.parametrize(
    ("settings", "schedule", "gamma"),
    [
        ({}, "fixed", 4),  # greedy: a fixed γ 4
        ({"temperature": 0.7}, "adaptive", AUTO_MAX_GAMMA),  # sampled: auto, as the CLI
        ({"temperature": 0.7, "gamma": 2}, "fixed", 2),
        ({"temperature": 0.7, "schedule": "fixed"}, "fixed", 4),
        ({"temperature": 0.7, "schedule": "adaptive", "gamma": 5}, "adaptive", 5),
        ({"gamma": "auto"}, "adaptive", AUTO_MAX_GAMMA),  # the CLI's forms work here too
        ({"gamma": "guard:2"}, "guarded", 2),
        ({"gamma": "hf"}, "heuristic", 4),
        ({"gamma": "auto", "schedule": "guarded"}, "guarded", AUTO_MAX_GAMMA),
    ],
)
def test_a_request_drafts_auto_when_sampling_unless_told(
    lookup: SpecGenerator, settings: dict[str, Any], schedule: str, gamma: int
) -> None:
    request = lookup.config(**settings)
    assert (request.schedule, request.gamma) == (schedule, gamma)


def test_a_given_config_and_plain_decoding_run_as_they_are(
    lookup: SpecGenerator, default_model: LoadedModel
) -> None:
    sampled = GenerationConfig(sampling=SamplingConfig(temperature=0.7))
    assert lookup.config(sampled) == sampled
    assert lookup.config(sampled, max_new_tokens=5).schedule == "fixed"
    plain = SpecGenerator(default_model)
    assert plain.config(temperature=0.7).schedule == "fixed"
    with pytest.raises(SpecMTPError, match="gamma must be"):
        lookup.config(gamma="sometimes")
    with pytest.raises(SpecMTPError, match="tuning profile"):
        lookup.config(gamma="best")


def test_generate_runs_the_chosen_request(lookup: SpecGenerator) -> None:
    prompt = "Name three colours, then name them again."
    chosen = lookup.generate(prompt, chat=True, max_new_tokens=16, temperature=0.7, seed=3)
    asked = lookup.generate(
        prompt, chat=True, max_new_tokens=16, temperature=0.7, seed=3, gamma="auto"
    )
    fixed = lookup.generate(prompt, chat=True, max_new_tokens=16, temperature=0.7, seed=3, gamma=4)
    assert chosen.tokens == asked.tokens
    assert chosen.stats.gamma == AUTO_MAX_GAMMA and fixed.stats.gamma == 4
