"""One prompt file from slices of several prompt sources, for a training mixture.

Each SOURCE:START:COUNT takes prompts START .. START+COUNT-1 of that source in the order
`--limit-per-source` takes them with seed 0 (`specmtp.train_prompts.source_prompts`), so a
slice can skip the prompts an earlier run took with `--limit-per-source START`:

    python scripts/prompt_mix.py --out mix.jsonl \
        runs/brown-prompts.jsonl:600:500 ../shared/train_prompts/gsm8k_train:500:250

Slices of one source file are disjoint. A longer prompt list of the same corpus (say
`corpus_prompts.py --limit 3000` after `--limit 2000`) is another source: the file keeps
the shorter one as a prefix, but `source_prompts` shuffles the whole file, so the same
START:COUNT takes other prompts, many of them the shorter list's. Give the earlier mixes as
--exclude: their prompts are skipped, and START and COUNT then count the source's other
prompts. A prompt is never taken twice within one mix either.

    python scripts/prompt_mix.py --out mix8.jsonl --exclude mix6.jsonl --exclude mix7.jsonl \
        runs/brown-prompts-3000.jsonl:0:400

Writes one {"prompt": ...} object per line, in the order given (train-mtp shuffles them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specmtp.errors import SpecMTPError
from specmtp.train_prompts import source_prompts


def parse_slice(spec: str) -> tuple[Path, int, int]:
    source, start, count = ([""] * 3 + spec.rsplit(":", 2))[-3:]  # a path may hold ":"
    if not (source and start.isdigit() and count.isdigit() and int(count) >= 1):
        raise SystemExit(f"prompt_mix: bad slice {spec!r}: want SOURCE:START:COUNT, COUNT >= 1")
    return Path(source), int(start), int(count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("slices", nargs="+", help="SOURCE:START:COUNT")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--exclude", type=Path, action="append", default=[],
        help="a prompt file or folder whose prompts no slice takes; repeatable",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        taken = {p for path in args.exclude for p in source_prompts(path, max_chars=None)}
    except SpecMTPError as error:
        raise SystemExit(f"prompt_mix: {error}") from None
    lines = []
    for source, start, count in map(parse_slice, args.slices):
        try:
            ordered = source_prompts(source)
        except SpecMTPError as error:
            raise SystemExit(f"prompt_mix: {error}") from None
        prompts = [p for p in ordered if p not in taken][start : start + count]
        if len(prompts) < count:
            raise SystemExit(f"prompt_mix: {source} has {len(prompts)} new prompts from {start}")
        excluded = sum(p in taken for p in ordered)
        taken.update(prompts)
        lines += [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
        print(f"{source}: {count} prompts from {start} ({excluded} of its prompts excluded)")
    args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"{len(lines)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
