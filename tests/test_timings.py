"""T(n) stored once per machine for sampled runs: a seed fixes the output in every process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, perturbed_copy, tiny_model
from test_schedule import VERIFY_S, ClockedDrafter, FakeTime
from transformers import PreTrainedModel

from specmtp import costmodel, decode, decode_schedules, native, timings
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.draft_model_drafter import DraftModelDrafter
from specmtp.kernels import KernelPlan, set_weight_layout, use_tuned_linear
from specmtp.stats import GenerationStats
from specmtp.timings import KernelPlanStore, TimingStore, use_stored_kernel_plan

PROMPT = [5, 17, 3, 88, 41, 5, 17, 3, 60, 2]
# Two machines' T(n) (ms per n): verifying more is nearly free on one, dear on the other.
FLAT = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)
STEEP = (1.0, 3.0, 5.0, 7.0, 9.0, 11.0)


@pytest.fixture(scope="module")
def target() -> PreTrainedModel:
    return tiny_model("llama", seed=0)


@pytest.fixture
def timed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Makes the next T(n) measurement return FLAT, then STEEP, ...: a new process each
    time on a machine whose timings differ. Records each measurement's max_tokens."""
    calls: list[int] = []

    def measure(*args: object, max_tokens: int, **kwargs: object) -> tuple[float, ...]:
        shape = (FLAT, STEEP)[len(calls) % 2]
        calls.append(max_tokens)
        return tuple(1e-3 * t for t in shape[:max_tokens])

    monkeypatch.setattr(decode_schedules, "measure_verify_costs", measure)
    return calls


def run(target: PreTrainedModel, store: TimingStore | None, temperature: float) -> list[int]:
    """One process: a new decoder and drafter, the adaptive schedule, seed 7."""
    drafter = DraftModelDrafter(perturbed_copy(target, scale=0.02, seed=1), vocab_size=TINY_VOCAB)
    decoder = SpecDecoder(
        target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256, timings=store
    )
    sampling = SamplingConfig(temperature=temperature)
    config = GenerationConfig(40, 4, sampling, seed=7, schedule="adaptive")
    return decoder.generate(PROMPT, config).tokens


def test_a_seed_fixes_the_sampled_output_when_t_n_is_stored(
    target: PreTrainedModel, timed: list[int], tmp_path: Path
) -> None:
    # Without a store each process times T(n) itself, and the text follows the clock.
    assert run(target, None, 0.8) != run(target, None, 0.8)
    assert timed == [5, 5]
    store = TimingStore.for_model(target, root=tmp_path)
    first = run(target, store, 0.8)
    assert run(target, store, 0.8) == run(target, store, 0.8) == first
    assert timed == [5, 5, 5]  # the first run timed and stored; the others read
    assert store.load() == pytest.approx(tuple(1e-3 * t for t in FLAT[:5]))


def test_greedy_runs_still_time_t_n_in_their_own_process(
    target: PreTrainedModel, timed: list[int], tmp_path: Path
) -> None:
    store = TimingStore.for_model(target, root=tmp_path)
    run(target, store, 0.0)
    run(target, store, 0.0)
    assert timed == [5, 5]
    assert store.load() == ()


def test_the_store_appends_larger_sizes_and_keeps_the_stored_ones(tmp_path: Path) -> None:
    store = TimingStore(tmp_path, {"machine": 1})
    assert store.load() == ()
    assert store.keep((1.0, 2.0)) == (1.0, 2.0)
    assert store.keep((5.0, 6.0, 7.0)) == (1.0, 2.0, 7.0)
    assert store.keep((9.0,)) == (1.0, 2.0, 7.0)
    assert TimingStore(tmp_path, {"machine": 1}).load() == (1.0, 2.0, 7.0)
    assert list(tmp_path.iterdir()) == [store.path]  # no temporary left


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "Expecting"),
        (json.dumps({"key": {"machine": 2}, "seconds": [1.0]}), "another model or machine"),
        (json.dumps({"key": {"machine": 1}, "seconds": [-1.0]}), "negative"),
        (json.dumps({"key": {"machine": 1}}), "seconds"),
    ],
)
def test_an_unreadable_store_is_reported_and_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, reason: str
) -> None:
    store = TimingStore(tmp_path, {"machine": 1})
    store.path.write_text(content)
    assert store.load() == ()
    message = capsys.readouterr().err
    assert message.startswith("specmtp: ignoring stored timings") and reason in message
    assert store.keep((3.0, 4.0)) == (3.0, 4.0)
    assert store.load() == (3.0, 4.0)


def test_the_store_is_kept_per_model_and_thread_count(
    target: PreTrainedModel, tmp_path: Path
) -> None:
    store = TimingStore.for_model(target, root=tmp_path)
    assert TimingStore.for_model(target, root=tmp_path) == store
    other = tiny_model("llama", seed=1)
    assert TimingStore.for_model(other, root=tmp_path).path != store.path
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    assert TimingStore.for_model(target, root=tmp_path).path != store.path


def test_each_kernel_plan_keeps_its_own_store(tmp_path: Path) -> None:
    """T(n) stored under one kernel plan (kernels.py) is not read under another: a bench
    measures a plan of its own after building its generators, so the store reads the plan
    the model runs when it is used, not when it was made."""
    model = tiny_model("llama", seed=6)
    plan = use_tuned_linear(model)
    store = TimingStore.for_model(model, root=tmp_path)
    assert store.keep((1.0, 1.1)) == (1.0, 1.1)
    first = store.path
    plan.by_rows = {**plan.by_rows, 2: "even" if plan.strategy(2) != "even" else "all"}
    assert store.path != first and store.load() == ()  # another plan: timed again
    assert store.keep((2.0, 2.5)) == (2.0, 2.5)
    second = store.path
    set_weight_layout(model, "in-major" if plan.layout != "in-major" else "out-major")
    assert store.path not in (first, second) and store.load() == ()
    assert json.loads(first.read_text())["seconds"] == [1.0, 1.1]  # each plan's kept
    assert json.loads(second.read_text())["seconds"] == [2.0, 2.5]


def test_row_invariant_forwards_keep_a_store_per_attention_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C attention kernel's T(n) is not the torch loop's: neither reads the other's."""
    model = tiny_model("llama", seed=5)
    plan = use_tuned_linear(model)
    plain = TimingStore.for_model(model, root=tmp_path).path
    paths = []
    for attention in (native.NATIVE, native.LOOP):
        monkeypatch.setattr(plan, "row_invariant_attention", attention)
        paths.append(TimingStore.for_model(model, root=tmp_path).path)
    assert len({plain, *paths}) == 3
    monkeypatch.undo()
    assert TimingStore.for_model(model, root=tmp_path).path == plain


def sample_with_stored_costs(
    target: PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    drafter: ClockedDrafter,
    stored_draft_costs: bool = True,
) -> tuple[GenerationStats, TimingStore]:
    """40 sampled tokens from `drafter` under the adaptive schedule, target forwards
    taking VERIFY_S each on the drafter's fake clock, with T(n) and (if asked) the draft
    costs in stores under tmp_path. Returns the run's stats and the draft costs' store."""
    clock = drafter.clock
    monkeypatch.setattr(decode, "time", clock)
    monkeypatch.setattr(decode_schedules, "time", clock)
    monkeypatch.setattr(costmodel, "time", clock)
    store = TimingStore.for_model(target, root=tmp_path)
    draft_store = TimingStore.for_model(target, drafter=drafter, root=tmp_path)
    decoder = SpecDecoder(
        target, drafter=drafter, vocab_size=TINY_VOCAB, context_length=256, timings=store,
        draft_timings=draft_store if stored_draft_costs else None,
    )  # fmt: skip
    forward = decoder.target.forward

    def timed_forward(tokens: torch.Tensor, **kwargs: object) -> torch.Tensor:
        clock.now += VERIFY_S
        return forward(tokens, **kwargs)

    monkeypatch.setattr(decoder.target, "forward", timed_forward)
    sampling = SamplingConfig(temperature=0.8)
    config = GenerationConfig(40, 8, sampling, seed=3, schedule="adaptive")
    return decoder.generate(PROMPT, config).stats, draft_store


@pytest.mark.parametrize("stored_draft_costs", [True, False])
def test_sampled_runs_know_what_a_draft_costs(
    target: PreTrainedModel,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    stored_draft_costs: bool,
) -> None:
    """The target drafting for itself, each draft token costing a target step on a fake
    clock: under sampling every draft is accepted (p = q), yet no γ pays. Without timing
    feedback the draft cost must come from the store (timed once, before generating);
    taken as free, the schedule drafted every round."""
    drafter = ClockedDrafter(target, FakeTime(), per_token=VERIFY_S)
    stats, draft_store = sample_with_stored_costs(
        target, monkeypatch, tmp_path, drafter, stored_draft_costs
    )
    if stored_draft_costs:
        assert draft_store.load() == pytest.approx((0.0, VERIFY_S, 0.0))  # reads cost nothing
        assert stats.requested_gammas == {0: stats.rounds}  # plain decoding: nothing pays
    else:
        assert stats.drafted_tokens > stats.rounds  # drafts taken as free


def test_sampled_runs_know_what_reading_the_prompt_costs(
    target: PreTrainedModel, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Drafts cheap and always accepted (the target drafting for itself, under sampling),
    but each token the draft model reads before its first draft costs six target steps:
    its read of the 10-token prompt costs more than the 40 tokens of plain decoding. The
    store times that price per token; taken as free (a store from before it was timed),
    the schedule drafted and the run took longer."""
    per_read = 6 * VERIFY_S
    priced, draft_store = sample_with_stored_costs(
        target, monkeypatch, tmp_path / "timed",
        ClockedDrafter(target, FakeTime(), per_token=VERIFY_S / 10, per_read=per_read),
    )  # fmt: skip
    assert draft_store.load() == pytest.approx((0.0, VERIFY_S / 10, per_read))
    assert priced.requested_gammas == {0: priced.rounds}
    free = ClockedDrafter(target, FakeTime(), per_token=VERIFY_S / 10, per_read=per_read)
    TimingStore.for_model(target, drafter=free, root=tmp_path / "free").keep(
        (0.0, VERIFY_S / 10, 0.0)
    )
    unpriced, _ = sample_with_stored_costs(target, monkeypatch, tmp_path / "free", free)
    assert unpriced.drafted_tokens > 0
    assert priced.total_s < unpriced.total_s


@pytest.fixture
def plan_measurements(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[dict]:
    """A fresh cache; records each kernel-plan measurement's max_rows and layouts, and
    makes the plan it returns pick `plain` for one row (what a later measurement on a
    noisy machine might pick instead of what was stored)."""
    monkeypatch.setenv("SPECMTP_CACHE", str(tmp_path / "cache"))
    calls: list[dict] = []
    measure = timings.measure_kernel_plan

    def counting(*args: object, **kwargs: object) -> KernelPlan | None:
        calls.append(kwargs)
        plan = measure(*args, **kwargs)
        if plan is not None and len(calls) > 1:
            plan.by_rows[1] = "plain" if plan.by_rows[1] != "plain" else "even"
        return plan

    monkeypatch.setattr(timings, "measure_kernel_plan", counting)
    return calls


def test_the_kernel_plan_is_measured_once_per_machine_then_only_extended(
    plan_measurements: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model("llama", seed=3)
    plan = use_tuned_linear(model)
    assert use_stored_kernel_plan(model, rows=2, context_length=256) is plan
    assert [c["max_rows"] for c in plan_measurements] == [2]
    assert plan_measurements[0]["layouts"] == ("out-major",)  # the weights as loaded
    first, layout = dict(plan.by_rows), plan.layout
    assert set(first) == {1, 2} and "once" in capsys.readouterr().err

    plan.by_rows = {}  # a new process: the default plan until the stored one is read
    use_stored_kernel_plan(model, rows=2, context_length=256)
    assert plan.by_rows == first and len(plan_measurements) == 1  # read, not measured

    use_stored_kernel_plan(model, rows=4, context_length=256)  # more rows: extended
    assert plan_measurements[1]["max_rows"] == 4 and plan_measurements[1]["layouts"] == (layout,)
    assert set(plan.by_rows) == {1, 2, 3, 4} and plan.layout == layout
    assert {n: plan.by_rows[n] for n in first} == first  # the stored rows keep their kernels
    stored = json.loads(KernelPlanStore.for_model(model).path.read_text())
    assert stored["by_rows"] == {str(n): s for n, s in plan.by_rows.items()}


def test_an_unusable_stored_kernel_plan_is_reported_and_measured_again(
    plan_measurements: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_model("llama", seed=3)
    plan = use_tuned_linear(model)
    store = KernelPlanStore.for_model(model)
    store.path.parent.mkdir(parents=True)
    store.path.write_text(json.dumps({"key": store.key, "by_rows": {"1": "fast"}, "layout": "x"}))
    use_stored_kernel_plan(model, rows=1, context_length=256)
    assert "ignoring stored kernel plan" in capsys.readouterr().err
    assert len(plan_measurements) == 1 and set(plan.by_rows) == {1}
    other = KernelPlanStore.for_model(tiny_model("llama", seed=4))
    assert other.path != store.path  # other weights: another file


def test_no_kernel_plan_is_stored_for_plain_kernels(plan_measurements: list[dict]) -> None:
    model = tiny_model("llama", seed=3)  # layers not swapped: F.linear everywhere
    assert use_stored_kernel_plan(model, rows=3, context_length=256) is None
    assert plan_measurements == [] and not KernelPlanStore.for_model(model).path.exists()
