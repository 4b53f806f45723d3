"""A dynamic tree's node count left to tuning: `mtp-tree#nodes=auto` alone, after `ngram+`
and merged after `ngram|`, and a draft model's tree `MODEL#nodes=auto` (specs.split_tree_nodes,
tune.node_counts, tune.build_nodes_profile, api.use_profile_nodes).

One tune run of the lookup-first drafter on the default model (node counts 2 and 4, 2 short
prompts) is shared by the end-to-end tests. Which count is fastest depends on the machine:
only that the profile keeps the fastest measured one, and that generation then verifies it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from conftest import run_captured, run_cli
from test_tune import GENERATE, assert_one_line_error, last_json, write_train_prompts

from specmtp.adaptive_schedule import AdaptiveGamma
from specmtp.api import SpecGenerator, make_config
from specmtp.drafter_specs import build_drafter
from specmtp.errors import SpecMTPError
from specmtp.models import LoadedModel
from specmtp.mtp_drafter import dynamic_tree_drafter
from specmtp.profile import Profile, default_profile_path, sweep_table
from specmtp.specs import split_tree_nodes
from specmtp.tune_nodes import node_counts
from specmtp.tune_runs import TuneConfig

DRAFT = "ngram+mtp-tree#nodes=auto"
DRAFT_TREE = "distilled#int8#nodes=auto"  # a draft model's tree (draft_tree_drafter.py)
NEW_TOKENS = 12
SHIPPED_TREE_NODES = 16  # the shipped heads' tree.json


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("mtp-tree#nodes=auto", ("mtp-tree", None, True)),
        ("mtp-tree:x.json#nodes=auto", ("mtp-tree:x.json", None, True)),
        ("mtp-tree#nodes=6", ("mtp-tree", 6, False)),
        ("mtp-tree", ("mtp-tree", None, False)),
    ],
)
def test_split_tree_nodes(spec: str, parsed: tuple[str, int | None, bool]) -> None:
    assert split_tree_nodes(spec, "N") == parsed


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mtp-tree#nodes=autox", "with N >= 1"),
        ("mtp-tree#nodes=0", "with N >= 1"),
        ("#nodes=auto", "with N >= 1"),
    ],
)
def test_bad_node_counts_are_refused(spec: str, message: str) -> None:
    with pytest.raises(SpecMTPError, match=message):
        split_tree_nodes(spec, "N")


def test_auto_nodes_apply_to_mtp_trees_and_draft_models_only(default_model: LoadedModel) -> None:
    for spec in ("mtp#nodes=auto", "ngram+mtp#nodes=auto", "ngram#nodes=auto"):
        with pytest.raises(SpecMTPError, match="applies to mtp-tree and draft models"):
            build_drafter(spec, default_model)


def test_auto_nodes_without_a_profile_fail_before_any_work(default_model: LoadedModel) -> None:
    for spec in ("mtp-tree#nodes=auto", DRAFT, "ngram|mtp-tree#nodes=auto", DRAFT_TREE):
        with pytest.raises(SpecMTPError, match="takes its node count from its tuning profile"):
            SpecGenerator(default_model, draft=spec)


@pytest.mark.parametrize(
    ("spec", "counts", "dropped"),
    [
        # alone, no count beyond the heads' tree: it could verify no more
        ("mtp-tree#nodes=auto", (2,), "node counts [40] dropped: the heads' tree has 16 nodes"),
        (DRAFT, (2,), "node counts [40] dropped"),
        # merged: the copied nodes come on top of the heads' tree
        ("ngram|mtp-tree#nodes=auto", (2, 40), None),
        # a fixed count alone is measured at that count; with a lookup arm, γ pairs are swept
        ("mtp-tree#nodes=5", (5,), None),
        ("ngram+mtp-tree#nodes=5", (), None),
        ("mtp-tree", (), None),
        # a draft model's tree: no tree bounds its count; a fixed count has its γ swept
        (DRAFT_TREE, (2, 40), None),
        (f"ngram+{DRAFT_TREE}", (2, 40), None),
        ("distilled#nodes=4", (), None),
    ],
)
def test_node_counts_swept(
    default_model: LoadedModel, tmp_path: Path, spec: str, counts: tuple[int, ...],
    dropped: str | None,
) -> None:  # fmt: skip
    train = write_train_prompts(tmp_path / "train")
    config = TuneConfig(prompts=(train,), draft=spec, budgets=(40, 2))
    drafter, _ = build_drafter(spec, default_model)
    lines: list[str] = []
    assert node_counts(dynamic_tree_drafter(drafter), drafter, config, lines.append) == counts
    if dropped is not None:
        assert any(line.startswith(dropped) for line in lines), lines


# --- end to end: tune --draft 'ngram+mtp-tree#nodes=auto' -----------------------------


@pytest.fixture(scope="module")
def tuned_nodes(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, Path]:
    root = tmp_path_factory.mktemp("tune-nodes")
    train = write_train_prompts(root / "train")
    profile = root / "out" / "nodes.json"
    code, out, err = run_captured(
        "tune", "--prompts", str(train), "--draft", DRAFT, "--budgets", "4,2",
        "--limit", "2", "--max-new-tokens", str(NEW_TOKENS), "--out", str(profile),
        "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    return out, err, profile


@pytest.fixture
def nodes_profile(tuned_nodes: tuple[str, str, Path]) -> Profile:
    return Profile.load(tuned_nodes[2])


def test_tune_sweeps_node_counts(
    tuned_nodes: tuple[str, str, Path], nodes_profile: Profile
) -> None:
    out, err, _ = tuned_nodes
    assert out.strip().splitlines()[0].split() == [
        "nodes", "predicted", "measured", "tokens/s", "τ"
    ]  # fmt: skip
    assert "tokens/s by nodes verified a round" in err
    sweep = nodes_profile.sweep
    assert [row["budget"] for row in sweep] == [0, 2, 4]
    depth = nodes_profile.meta["node_sweep"]["depth"]
    lookup = nodes_profile.meta["node_sweep"]["lookup_gamma"]
    for row in sweep[1:]:  # every count at the same γ pair: the lookup's default, full depth
        assert (row["gamma"], row["model_gamma"]) == (lookup, depth)
        assert row["predicted_speedup"] > 0 and row["mean_accepted_tokens"] >= 1.0
    fastest = max(sweep[1:], key=lambda row: row["measured_speedup"])
    assert nodes_profile.nodes == fastest["budget"]
    assert (nodes_profile.best_gamma, nodes_profile.model_gamma) == (lookup, depth)
    assert "model" in nodes_profile.arm_alphas and set(nodes_profile.arm_alphas) <= {
        "lookup",
        "model",
    }
    assert f"best node count {nodes_profile.nodes}" in out
    assert last_json(out) == nodes_profile.to_dict()


def test_generate_verifies_the_profiles_node_count(
    capfd: pytest.CaptureFixture[str], tuned_nodes: tuple[str, str, Path], nodes_profile: Profile
) -> None:
    argv = [*GENERATE, "--draft", DRAFT, "--gamma", "4/3", "--profile", str(tuned_nodes[2])]
    code, out, err = run_cli(capfd, *argv, "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0, err
    sizes = set(map(int, last_json(out)["verify_sizes"]))
    assert nodes_profile.nodes is not None
    # model rounds verify the profile's count (+ the root); lookup rounds a copied chain
    assert max(sizes) <= max(nodes_profile.nodes, 4) + 1
    code, plain_out, err = run_cli(capfd, *GENERATE, "--max-new-tokens", str(NEW_TOKENS))
    assert code == 0, err
    assert out.splitlines()[0] == plain_out.splitlines()[0]  # greedy text unchanged


def test_dynamic_tree_verifies_exactly_the_profiles_count(
    default_model: LoadedModel, nodes_profile: Profile
) -> None:
    """Alone, every tree round of `mtp-tree#nodes=auto` verifies the profile's count."""
    for count in (1, 3):
        profile = replace(nodes_profile, draft="mtp-tree#nodes=auto", model_gamma=None,
                          arm_alphas={}, nodes=count)  # fmt: skip
        gen = SpecGenerator(default_model, draft="mtp-tree#nodes=auto", profile=profile)
        heads = dynamic_tree_drafter(gen.decoder.drafter)
        assert heads is not None and heads.nodes == count
        stats = gen.generate("Name the days of the week.", chat=True, max_new_tokens=10).stats
        assert set(stats.verify_sizes) - {1} == {count + 1}  # 1: the first, headless round


def test_bench_and_generate_find_the_default_profile(
    capfd: pytest.CaptureFixture[str], nodes_profile: Profile, no_profiles: Path
) -> None:
    """`#nodes=auto` reads its profile at the default path whatever the γ; without one, a
    one-line error."""
    code, out, err = run_cli(capfd, *GENERATE, "--draft", DRAFT, "--gamma", "2")
    assert_one_line_error(code, out, err, "takes its node count from its tuning profile")
    nodes_profile.save(default_profile_path("default", DRAFT))
    code, out, err = run_cli(
        capfd, "bench", "--prompts", "random:1x8", "--draft", f"{DRAFT}@auto",
        "--draft", f"{DRAFT}@2/3", "--max-new-tokens", "6", "--warmup", "0", "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    methods = last_json(out)["methods"]
    assert methods[f"{DRAFT}@auto"]["schedule"] == "adaptive"
    assert methods[f"{DRAFT}@2/3"]["greedy_mismatches"] == 0


def test_profiles_node_count_must_fit_the_draft(
    default_model: LoadedModel, nodes_profile: Profile
) -> None:
    with pytest.raises(SpecMTPError, match="holds a node count, but this draft has no dynamic"):
        SpecGenerator(default_model, draft="ngram+mtp-tree", profile=replace(
            nodes_profile, draft="ngram+mtp-tree"))  # fmt: skip
    other = 9 if nodes_profile.nodes != 9 else 8
    spec = f"ngram+mtp-tree#nodes={other}"
    with pytest.raises(SpecMTPError, match=f"tuned at {nodes_profile.nodes} nodes, this draft"):
        SpecGenerator(default_model, draft=spec, profile=replace(nodes_profile, draft=spec))


def test_node_profile_round_trip_and_checks(nodes_profile: Profile) -> None:
    assert Profile.from_dict(nodes_profile.to_dict()) == nodes_profile
    assert sweep_table(nodes_profile).splitlines()[0].startswith("nodes")
    old = nodes_profile.to_dict()
    del old["nodes"]  # a profile written before node sweeps
    assert Profile.from_dict(old).nodes is None
    for bad in (0, 65):
        with pytest.raises(SpecMTPError, match=r"node count must be in 1\.\.64"):
            Profile.from_dict({**nodes_profile.to_dict(), "nodes": bad})


@pytest.mark.parametrize("tuned_at", [0.0, 1.0])
def test_alpha_priors_hold_under_the_sampling_they_were_tuned_with(
    default_model: LoadedModel, nodes_profile: Profile, tuned_at: float
) -> None:
    """A profile's α (and α per arm) start the adaptive schedule only at the temperature
    it was tuned at; its costs hold at any."""
    profile = replace(nodes_profile, meta={**nodes_profile.meta, "temperature": tuned_at})
    schedules = SpecGenerator(default_model, draft=DRAFT, profile=profile).decoder.schedules
    for temperature in (0.0, 0.7, 1.0):
        config = make_config(gamma=4, model_gamma=3, schedule="adaptive", temperature=temperature)
        schedule = schedules.for_arm(config, "model", profile.cost_model)
        assert isinstance(schedule, AdaptiveGamma)
        prior = list(profile.arm_alphas["model"][: schedule.max_gamma])
        assert schedule.prior == (prior if temperature == tuned_at else [])
        assert schedule.cost.verify_s == profile.cost_model.verify_s


# --- a draft model's tree: tune --draft 'distilled#int8#nodes=auto' --------------------


def test_tune_picks_a_draft_trees_node_count_and_generation_uses_it(
    default_model: LoadedModel, tmp_path: Path
) -> None:
    """The sweep runs each count with the adaptive schedule (a draft tree is as deep as γ),
    keeps the fastest measured one, and a generator given the profile drafts trees of
    that many nodes; its greedy text is plain decoding's."""
    train = write_train_prompts(tmp_path / "train")
    path = tmp_path / "tree.json"
    code, out, err = run_captured(
        "tune", "--prompts", str(train), "--draft", DRAFT_TREE, "--budgets", "1,3",
        "--limit", "1", "--max-new-tokens", str(NEW_TOKENS), "--max-gamma", "3",
        "--out", str(path), "--threads", "1",
    )  # fmt: skip
    assert code == 0, err
    assert "tokens/s by nodes verified a round" in err
    profile = Profile.load(path)
    assert [row["budget"] for row in profile.sweep] == [0, 1, 3]
    assert profile.meta["node_sweep"] == {"depth": 3, "lookup_gamma": None, "schedule": "adaptive"}
    fastest = max(profile.sweep[1:], key=lambda row: row["measured_speedup"])
    assert profile.nodes == fastest["budget"]
    assert f"best node count {profile.nodes}" in out and last_json(out) == profile.to_dict()
    gen = SpecGenerator(default_model, draft=DRAFT_TREE, profile=profile)
    tree = dynamic_tree_drafter(gen.decoder.drafter)
    assert tree is not None and tree.nodes == profile.nodes
    prompt = "Name the days of the week."
    stats = gen.generate(prompt, chat=True, max_new_tokens=10, gamma=3).stats
    assert max(stats.verify_sizes) <= profile.nodes + 1
    plain = SpecGenerator(default_model).generate(prompt, chat=True, max_new_tokens=10)
    assert gen.generate(prompt, chat=True, max_new_tokens=10, gamma=3).tokens == plain.tokens
