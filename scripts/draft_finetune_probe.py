"""Does fine-tuning a pretrained draft on the target's own answers raise their agreement?

A probe, not a training command: it reads a `distill --data-only` cache of the target's
answers with their top-k log-probabilities (the Qwen 1.5B's 280 answers in
docs/draft-models.md), holds out a fraction of the answers (the same hash split as the
trainers), and trains the last `--layers` decoder layers and the final norm of a Hugging Face
draft (the 0.5B, its embedding and tied output matrix frozen) on the rest, with the
cross-entropy to the target's top-k distribution renormalised (forward KL up to a constant,
as DistillSpec). Before and after, it prints the draft's top-1 agreement with the target's
top-1 on the held-out answers, teacher-forced, which is what greedy acceptance counts.

    python scripts/draft_finetune_probe.py --draft ~/.cache/specmtp/qwen2.5-coder-0.5b-... \
        --cache ~/.cache/specmtp/runs/qwen15-data --layers 4 --steps 60 --lr 1e-5

Used in docs/draft-models.md ("Wider draft trees, and the draft fine-tuned on the 1.5B's
answers").
"""

from __future__ import annotations

import argparse
import itertools
import math
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from specmtp.data import is_heldout

Sample = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # ids, mask, top-k


def read_samples(cache: Path) -> list[Sample]:
    samples = []
    for shard in sorted(cache.glob("shard-*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            ids, offsets = f.get_tensor("input_ids").long(), f.get_tensor("offsets").tolist()
            mask = f.get_tensor("loss_mask")
            top_ids = f.get_tensor("topk_indices").long()
            top_logprobs = f.get_tensor("topk_values").float()
        for a, b in itertools.pairwise(offsets):
            samples.append((ids[a:b], mask[a:b], top_ids[a:b], top_logprobs[a:b]))
    return samples


def predicting_answers(mask: torch.Tensor) -> torch.Tensor:
    """Positions whose next token is an answer token (their logits predict it)."""
    found = torch.zeros_like(mask)
    found[:-1] = mask[1:]
    return found


def draft_logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(ids[None]).logits[0].float()  # [T, V]


@torch.no_grad()
def agreement(model: PreTrainedModel, samples: list[Sample]) -> tuple[float, int]:
    hits = total = 0
    for ids, mask, top_ids, _ in samples:
        where = predicting_answers(mask)
        hits += int((draft_logits(model, ids).argmax(-1)[where] == top_ids[where, 0]).sum())
        total += int(where.sum())
    return hits / total, total


def loss_of(model: PreTrainedModel, sample: Sample) -> torch.Tensor:
    ids, mask, top_ids, top_logprobs = sample
    where = predicting_answers(mask)
    logq = draft_logits(model, ids)[where].log_softmax(-1)  # [N, V]
    p = top_logprobs[where].softmax(-1)  # the target's top-k, renormalised  [N, k]
    return -(p * logq.gather(-1, top_ids[where])).sum(-1).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft", required=True, help="a Hugging Face model directory")
    parser.add_argument("--cache", required=True, type=Path, help="a distill --data-only cache")
    parser.add_argument("--layers", type=int, default=4, help="last decoder layers trained")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--heldout-fraction", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    samples = read_samples(args.cache)
    heldout = [s for i, s in enumerate(samples) if is_heldout(i, args.heldout_fraction)]
    train = [s for i, s in enumerate(samples) if not is_heldout(i, args.heldout_fraction)]
    print(f"{len(samples)} answers: {len(train)} to train, {len(heldout)} held out")
    model = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.bfloat16).eval()
    rate, positions = agreement(model, heldout)
    print(f"before: held-out top-1 agreement {rate:.4f} over {positions} positions")
    model.requires_grad_(False)
    trained = [*model.model.layers[-args.layers :], model.model.norm]
    for module in trained:
        module.float().requires_grad_(True)  # float32 master weights, bfloat16 products
    params = [p for module in trained for p in module.parameters()]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    picks = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        warm_then_cosine = min(1.0, step / 10) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm_then_cosine
        total = 0.0
        for i in torch.randint(len(train), (args.batch_size,), generator=picks).tolist():
            loss = loss_of(model, train[i]) / args.batch_size
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0:
            print(f"step {step}: loss {total:.3f} ({time.perf_counter() - start:.0f} s)")
    rate, _ = agreement(model.eval(), heldout)
    print(f"after: held-out top-1 agreement {rate:.4f}")


if __name__ == "__main__":
    main()
