"""Logits processing against Hugging Face's own warpers, and the greedy verification rule."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specmtp import native
from specmtp.config import SamplingConfig
from specmtp.sampling import greedy_tokens, logits_to_probs, top_log_probs
from specmtp.verification import verify_greedy, verify_rejection_sampling


def hf_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    scores = TemperatureLogitsWarper(cfg.temperature)(None, logits.clone())
    if cfg.top_k:
        scores = TopKLogitsWarper(cfg.top_k)(None, scores)
    if cfg.top_p < 1:
        scores = TopPLogitsWarper(cfg.top_p)(None, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=1.0),
        SamplingConfig(temperature=0.6, top_k=5),
        SamplingConfig(temperature=1.3, top_p=0.7),
        SamplingConfig(temperature=0.9, top_k=12, top_p=0.85),
    ],
)
def test_logits_to_probs_matches_hf_warpers(cfg: SamplingConfig) -> None:
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0)) * 3
    torch.testing.assert_close(logits_to_probs(logits, cfg), hf_probs(logits, cfg))


def test_greedy_probs_are_one_hot_argmax() -> None:
    logits = torch.randn(3, 4, 10)
    probs = logits_to_probs(logits, SamplingConfig())
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_is_the_first_maximum_in_the_logits_own_values(dtype: torch.dtype) -> None:
    """Ties (values that only differ past the dtype's precision) keep the first index, and
    bfloat16's range (beyond float16's) survives."""
    big = 1e30 if dtype == torch.bfloat16 else 1e4
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [-big, big / 2, big, big]]).to(dtype)
    assert greedy_tokens(logits).tolist() == [1, 2]
    random = torch.randn(5, 7, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(greedy_tokens(random), random.argmax(-1))


def test_verify_greedy_accepts_the_matching_prefix_per_row() -> None:
    argmax = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])  # [B, k+1]
    logits = torch.nn.functional.one_hot(argmax, 10).float()  # [B, k+1, V]
    drafts = torch.tensor([[4, 5, 6], [4, 9, 6], [1, 5, 6]])  # all, one, none accepted
    verdict = verify_greedy(drafts, logits)
    assert verdict.num_accepted.tolist() == [3, 1, 0]
    assert verdict.next_tokens.tolist() == [7, 5, 4]  # bonus, then the corrections


def test_rejection_sampling_at_temperature_zero_is_greedy() -> None:
    """With one-hot p and q the stochastic rule reduces exactly to the greedy one."""
    argmax = torch.randint(0, 10, (200, 5), generator=torch.Generator().manual_seed(1))
    p = torch.nn.functional.one_hot(argmax, 10).float()
    drafts = torch.where(torch.rand(200, 4) < 0.7, argmax[:, :4], torch.randint(0, 10, (200, 4)))
    expected = verify_greedy(drafts, p)
    got = verify_rejection_sampling(drafts, None, p, torch.Generator().manual_seed(2))
    assert torch.equal(got.num_accepted, expected.num_accepted)
    assert torch.equal(got.next_tokens, expected.next_tokens)


def test_rejection_sampling_reports_each_drafts_acceptance_probability() -> None:
    """accept_probs[i] = sum_v min(p_i, q_i), the probability that draft i is accepted once
    drafts before it were: checked against the formula and against the acceptances seen
    over many rows (20,000 rows, within 4 standard errors). One-hot drafts: p_i(x_i)."""
    generator = torch.Generator().manual_seed(5)
    rows, k, vocab = 20_000, 2, 6
    p = torch.rand(k + 1, vocab, generator=generator).softmax(-1).expand(rows, -1, -1)
    q = torch.rand(k, vocab, generator=generator).mul(3).softmax(-1).expand(rows, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).view(rows, k)
    verdict = verify_rejection_sampling(drafts, q, p, generator)
    beta = torch.minimum(p[0, :k], q[0]).sum(-1)  # [k]
    assert verdict.accept_probs is not None
    assert torch.allclose(verdict.accept_probs, beta.expand(rows, -1))
    first = (verdict.num_accepted >= 1).float()
    second = (verdict.num_accepted[first.bool()] >= 2).float()  # given the first accepted
    for seen, want in ((first, beta[0]), (second, beta[1])):
        error = (want * (1 - want) / len(seen)) ** 0.5
        assert abs(seen.mean() - want) < 4 * error

    fixed = verify_rejection_sampling(drafts, None, p, generator)  # one-hot drafts
    assert fixed.accept_probs is not None
    assert torch.allclose(fixed.accept_probs, p[:, :k].gather(-1, drafts[..., None])[..., 0])
    assert verify_greedy(drafts, p.log()).accept_probs is None  # greedy: outcomes are exact


@pytest.mark.parametrize("native_kernel", [True, False])
def test_top_log_probs_is_log_softmax_then_topk(
    native_kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lean.c's one-pass kernel and the torch path against log_softmax then topk: rows of a
    vocabulary that is not a whole number of vector lanes, -inf entries (a cut vocabulary),
    equal values (the lower index first in the kernel), k = 1 and k = V."""
    if not native_kernel:
        monkeypatch.setattr(native, "lean_kernels", lambda: None)
    elif native.lean_kernels() is None:
        pytest.skip("no C compiler for lean.c")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1003, generator=generator) * 5
    logits[1, ::3] = float("-inf")
    logits[2, [7, 500, 900]] = 40.0  # a three-way tie for the top
    for k in (1, 4, 1003):
        values, indices = top_log_probs(logits, k)
        expected = torch.log_softmax(logits, -1).topk(k, dim=-1)
        assert values.shape == indices.shape == (4, k) and indices.dtype == torch.int64
        torch.testing.assert_close(values, expected.values, rtol=1e-5, atol=1e-5)
        # The same tokens; log-softmax may round two logits to one value, which torch may
        # then order either way, while the kernel orders by the logits themselves.
        chosen, theirs = logits.gather(1, indices), logits.gather(1, expected.indices)
        assert torch.equal(chosen.sort(-1).values, theirs.sort(-1).values)
        if native_kernel:
            assert (chosen[:, :-1] >= chosen[:, 1:]).all()
            assert indices[2, :3].tolist() == [7, 500, 900][:k]
