"""Drafters of one draft model in one form (dtype, `#vocab=N`, `#int8`) share its weights
within sharing_draft_models(), as the bench builds them; each keeps its own caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import hf_greedy, run_cli
from transformers import PreTrainedModel

import specmtp
from specmtp import drafter_specs
from specmtp.api import SpecGenerator, build_drafter, eos_token_ids
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.drafter_specs import sharing_draft_models
from specmtp.drafters import Drafter, LookupFirstDrafter
from specmtp.int8 import Int8Linear
from specmtp.models import LoadedModel, load_model

CUT = 3000  # `#vocab=CUT`: the tiny target's output matrix cut to its first 3,000 tokens


@pytest.fixture(scope="module")
def loaded_target(tiny_target: Path) -> LoadedModel:
    return load_model(str(tiny_target))


def model_of(drafter: Drafter | None) -> PreTrainedModel:
    if isinstance(drafter, LookupFirstDrafter):
        drafter = drafter.fallback
    assert isinstance(drafter, DraftModelDrafter)
    model = drafter.runner.model
    assert isinstance(model, PreTrainedModel)
    return model


def test_drafters_of_one_model_in_one_form_share_it(
    loaded_target: LoadedModel, tiny_target: Path
) -> None:
    specs = [
        f"{tiny_target}#int8#nodes=3",
        f"{tiny_target}#int8#nodes=5",
        f"ngram+{tiny_target}#int8",
        f"{tiny_target}",
        f"{tiny_target}#vocab={CUT}",
        f"ngram+{tiny_target}#vocab={CUT}#nodes=4",
    ]
    with sharing_draft_models():
        models = [model_of(build_drafter(spec, loaded_target)[0]) for spec in specs]
    int8_tree, int8_tree_5, int8_chain, plain, cut, cut_tree = models
    assert int8_tree is int8_tree_5 is int8_chain
    assert cut is cut_tree
    assert len({id(int8_tree), id(plain), id(cut)}) == 3
    # Each form is still what its specs asked: int8 products, the full float head, the cut.
    assert isinstance(int8_tree.get_output_embeddings(), Int8Linear)
    assert plain.get_output_embeddings().weight.shape[0] == len(loaded_target.tokenizer)
    assert not isinstance(plain.get_output_embeddings(), Int8Linear)
    assert cut.get_output_embeddings().weight.shape[0] < CUT + 100
    # The package exports the context for the API's users.
    assert specmtp.sharing_draft_models is sharing_draft_models
    # Outside the context every drafter loads its own copy, as the API always did.
    alone = [model_of(build_drafter(spec, loaded_target)[0]) for spec in specs[:2]]
    assert alone[0] is not alone[1] and int8_tree not in alone


def test_drafters_sharing_a_model_keep_plain_decodings_output(
    loaded_target: LoadedModel, tiny_target: Path
) -> None:
    specs = [
        f"{tiny_target}#int8#nodes=4",
        f"{tiny_target}#int8",
        f"ngram+{tiny_target}#vocab={CUT}",
        f"{tiny_target}#vocab={CUT}#nodes=3",
    ]
    prompt = loaded_target.tokenizer("The colours of the rainbow are").input_ids
    expected = hf_greedy(loaded_target.model, prompt, 24, eos=eos_token_ids(loaded_target))
    with sharing_draft_models():
        generators = [SpecGenerator(loaded_target, draft=spec) for spec in specs]
    for generator in generators + generators[::-1]:  # interleaved: no drafter's cache leaks
        completion = generator.generate(prompt, max_new_tokens=24, gamma=3)
        assert completion.tokens == expected, generator.decoder.drafter.name
        assert completion.stats.accepted_tokens > 0


def test_the_bench_loads_a_draft_model_once_for_its_methods(
    tiny_target: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two trees, a chain and Hugging Face's assisted generation on one draft: one load for
    the float methods, one for the int8 one."""
    loads: list[str] = []
    load = drafter_specs.load_model

    def counted(spec: str, **kwargs: object) -> LoadedModel:
        loads.append(spec)
        return load(spec, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(drafter_specs, "load_model", counted)
    target = str(tiny_target)
    drafts = [f"{target}#nodes=3@2", f"{target}#nodes=4@2", f"{target}@2",
              f"hf-assisted:{target}@2", f"{target}#int8@2"]  # fmt: skip
    code, out, err = run_cli(
        capfd, "bench", "--target", target, "--prompts", "random:1x12", "--max-new-tokens", "8",
        "--warmup", "0", "--threads", "1", *[flag for d in drafts for flag in ("--draft", d)],
    )  # fmt: skip
    assert code == 0, err
    assert loads == [target, target]
    result = json.loads(out.strip().splitlines()[-1])
    methods = result["methods"]
    assert list(methods) == ["ar", *drafts]
    for name, method in methods.items():
        assert method["greedy_mismatches"] == 0, name
        assert method["new_tokens"] == methods["ar"]["new_tokens"], name
