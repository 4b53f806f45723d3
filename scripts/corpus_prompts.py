"""Chat prompts made from plain-text passages, for self-distillation data that looks like a
model's everyday use (summaries, explanations, essays, stories) rather than the narrow
training sets (grade-school maths, MBPP). Each passage of a corpus folder (`.txt` files,
cut into paragraph chunks as `train-mtp --data` cuts them) gets one task, chosen in turn
from a fixed list written for this script; fiction gets story tasks. No evaluation prompt
(`shared/prompts/eval/`) is used or imitated.

    python scripts/corpus_prompts.py ~/.cache/specmtp/runs/corpora/brown --out prompts.jsonl \
        [--max-chars 700] [--limit 1000] [--seed 0] [--all-fiction]

Writes one {"prompt": ...} object per line, shuffled with `--seed`. The Brown corpus names
its texts by genre: ck..cr are fiction (general, mystery, science fiction, adventure,
romance, humour). `--all-fiction` gives every passage story tasks (for a folder of novels,
such as Jane Austen's).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from specmtp.train_prompts import load_train_prompts

NON_FICTION = [
    "Summarize the following passage in a few sentences.\n\n{p}",
    "Explain the main ideas of this text to a high-school student.\n\n{p}",
    "Write a short essay on the subject of this passage, in your own words.\n\n{p}",
    "Write three questions a reader might ask about this text, and answer each.\n\n{p}",
    "Rewrite this paragraph in plain, simple English.\n\n{p}",
    "What is the author's point of view in this passage? Give reasons.\n\n{p}",
    "List the key facts in this text as bullet points.\n\n{p}",
    "Write a short news headline and a one-paragraph summary for this text.\n\n{p}",
]
FICTION = [
    "Continue this story for a few paragraphs.\n\n{p}",
    "Describe the characters in this passage and what they want.\n\n{p}",
    "Retell this scene from another character's point of view.\n\n{p}",
    "What do you think happens next? Explain, then write the next scene.\n\n{p}",
]
_FICTION_FILE = re.compile(r"c[k-r]\d+\.txt")


def passages(folder: Path, max_chars: int, all_fiction: bool = False) -> list[tuple[str, bool]]:
    """(passage, is_fiction) for each paragraph chunk, cut to about max_chars at a sentence."""
    found = []
    for path in sorted(folder.glob("*.txt")):
        fiction = all_fiction or bool(_FICTION_FILE.fullmatch(path.name))
        for chunk in load_train_prompts([path], seed=0, max_chars=None):
            if len(chunk) > max_chars:
                cut = chunk.rfind(". ", 0, max_chars)
                chunk = chunk[: cut + 1] if cut > max_chars // 3 else chunk[:max_chars]
            found.append((chunk, fiction))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-chars", type=int, default=700)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--all-fiction", action="store_true", help="story tasks for every text")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    chosen = passages(args.folder, args.max_chars, args.all_fiction)
    rng.shuffle(chosen)
    counts = {False: 0, True: 0}
    lines = []
    for passage, fiction in chosen[: args.limit]:
        tasks = FICTION if fiction else NON_FICTION
        template = tasks[counts[fiction] % len(tasks)]
        counts[fiction] += 1
        lines.append(json.dumps({"prompt": template.format(p=passage)}, ensure_ascii=False))
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts ({counts[True]} fiction) -> {args.out}")


if __name__ == "__main__":
    main()
