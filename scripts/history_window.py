"""How far back should sequential MTP depths attend while drafting at long contexts?

The shipped depths were trained on sequences of 320 tokens (NoPE: no positions, only the
causal mask). For long contexts this measures, on the target's own greedy answers after a
long context of training-prompt documents (never evaluation prompts), each depth's top-1
agreement with the answer's tokens (teacher-forced, the quantity a chain's acceptance follows)
when each position attends to all earlier positions, or only to the last W of them.

    python scripts/history_window.py --context 2048 --samples 4 --answer 96

Prints one line per window and a JSON line last.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from specmtp.drafter_specs import build_drafter
from specmtp.heads import SequentialMTP, target_features
from specmtp.models import load_model
from specmtp.train_prompts import source_prompts

SOURCES = ("self_instruct_en", "awesome_chatgpt_prompts_en", "mbpp", "gsm8k_train")


def windowed(window: int | None):
    """An `attend` for a whole-sequence block: causal, and with `window` only the last
    `window` keys for each query."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        n = q.shape[2]
        mask = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.ones(n, n, dtype=torch.bool).tril(
            -window
        )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def agreement(heads: SequentialMTP, features, ids, answer_from: int, window: int | None):
    """Per depth: (correct, total) top-1 over positions whose target lies in the answer."""
    n, out, state = ids.shape[1], [], heads.fuse(features)
    for i, depth in enumerate(heads.depths):
        state, normed = depth(state[:, : n - 1 - i], heads.embed(ids[:, 1 + i :]), windowed(window))
        rows = torch.arange(n - 2 - i)  # row s predicts x_{s+2+i}, inside the sequence
        keep = rows + 2 + i >= answer_from
        logits = heads.projection(normed[0, : n - 2 - i][keep])
        truth = ids[0, rows[keep] + 2 + i]
        out.append((int((heads.to_full_ids(logits.argmax(-1)) == truth).sum()), int(keep.sum())))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--answer", type=int, default=96)
    parser.add_argument("--windows", default="none,128,256,512,1024")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default", dtype=torch.bfloat16)
    drafter, _ = build_drafter("mtp", target, dtype=torch.bfloat16)
    heads = drafter.heads
    tok = target.tokenizer
    texts = [t for s in SOURCES for t in source_prompts(f"../shared/train_prompts/{s}")[:40]]
    windows = [None if w == "none" else int(w) for w in args.windows.split(",")]
    totals = {w: [[0, 0] for _ in heads.depths] for w in windows}
    for sample in range(args.samples):
        question, docs, count = texts[sample], [], 0
        for j in range(len(texts)):
            text = texts[(args.samples + sample * 50 + j) % len(texts)]
            docs.append(text)
            count += len(tok(text).input_ids)
            if count >= args.context:
                break
        body = "".join(f"Document {j + 1}:\n{d}\n\n" for j, d in enumerate(docs)) + question
        chat = tok.apply_chat_template(
            [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
        )
        prompt = tok(chat, return_tensors="pt").input_ids
        with torch.no_grad():
            ids = target.model.generate(prompt, max_new_tokens=args.answer, do_sample=False)
            out = target.model(ids, output_hidden_states=True)
        features = target_features(out.hidden_states, heads.config.feature_layers)
        with torch.no_grad():
            for w in windows:
                for d, (ok, total) in enumerate(
                    agreement(heads, features, ids, prompt.shape[1], w)
                ):
                    totals[w][d][0] += ok
                    totals[w][d][1] += total
        print(f"sample {sample}: {prompt.shape[1]} prompt tokens", flush=True)
    result = {}
    for w in windows:
        rates = [round(ok / max(total, 1), 3) for ok, total in totals[w]]
        result["none" if w is None else str(w)] = rates
        print(f"window {w}: top-1 per depth {rates}")
    print(json.dumps({"context": args.context, "samples": args.samples, "top1": result}))


if __name__ == "__main__":
    main()
