"""One prompt file from slices of several prompt sources, for a training mixture.

Each SOURCE:START:COUNT takes prompts START .. START+COUNT-1 of that source in the order
`--limit-per-source` takes them with seed 0 (`specmtp.train_prompts.source_prompts`), so a
slice can skip the prompts an earlier run took with `--limit-per-source START`:

    python scripts/prompt_mix.py --out mix.jsonl \
        runs/brown-prompts.jsonl:600:500 ../shared/train_prompts/gsm8k_train:500:250

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
    args = parser.parse_args()
    lines = []
    for source, start, count in map(parse_slice, args.slices):
        try:
            prompts = source_prompts(source)[start : start + count]
        except SpecMTPError as error:
            raise SystemExit(f"prompt_mix: {error}") from None
        if len(prompts) < count:
            raise SystemExit(f"prompt_mix: {source} has {len(prompts)} prompts from {start}")
        lines += [json.dumps({"prompt": p}, ensure_ascii=False) for p in prompts]
        print(f"{source}: {count} prompts from {start}")
    args.out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts -> {args.out}")


if __name__ == "__main__":
    main()
