"""T(n) stored once per machine for sampled runs: a seed fixes the output in every process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY_VOCAB, perturbed_copy, tiny_model
from transformers import PreTrainedModel

from specmtp import decode
from specmtp.config import GenerationConfig, SamplingConfig
from specmtp.decode import SpecDecoder
from specmtp.drafters import DraftModelDrafter
from specmtp.timings import TimingStore

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

    monkeypatch.setattr(decode, "measure_verify_costs", measure)
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
    store = TimingStore(tmp_path / "t.json", {"machine": 1})
    assert store.load() == ()
    assert store.keep((1.0, 2.0)) == (1.0, 2.0)
    assert store.keep((5.0, 6.0, 7.0)) == (1.0, 2.0, 7.0)
    assert store.keep((9.0,)) == (1.0, 2.0, 7.0)
    assert TimingStore(store.path, {"machine": 1}).load() == (1.0, 2.0, 7.0)
    assert not [p for p in tmp_path.iterdir() if p.name != "t.json"]  # no temporary left


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("{not json", "Expecting"),
        (json.dumps({"key": {"machine": 2}, "verify_s": [1.0]}), "another model or machine"),
        (json.dumps({"key": {"machine": 1}, "verify_s": [0.0]}), "not positive"),
        (json.dumps({"key": {"machine": 1}}), "verify_s"),
    ],
)
def test_an_unreadable_store_is_reported_and_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, reason: str
) -> None:
    store = TimingStore(tmp_path / "t.json", {"machine": 1})
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
