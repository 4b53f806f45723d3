"""What a tree round costs in bfloat16 (row-invariant forwards), default model, 1 thread.
Usage:

    python scripts/tree_costs.py [--context 115] [--sweeps 9]

After a prompt of --context tokens: the shipped sequential heads drafting their 16-node
tree and a 3-token chain (ms a draft), then target forwards of 1, 4 and 17 chain tokens and
of the 17-row tree (root and 16 nodes, with its mask), in ms, and the share of the tree
forward spent outside matrix products (torch profiler). Each figure is the median over
sweeps of the median of 3 timed calls; kinds take turns within a sweep. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.profiler import profile

from specmtp.api import SpecGenerator, build_mtp_drafter
from specmtp.models import load_model
from specmtp.mtp_cache import SequentialDraftCache
from specmtp.tree import tree_forward

TEXT = (
    "Write a short story about a robot who learns to paint. Make it long and detailed, "
    "with many characters and a twist at the end. "
)


def timed(fn: Callable[[], object], after: Callable[[], None]) -> float:
    times = []
    for _ in range(4):  # the first warms up
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        after()
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=115)
    parser.add_argument("--sweeps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("default", dtype=torch.bfloat16)
    gen = SpecGenerator(target)
    runner = gen.decoder.target
    drafter = build_mtp_drafter("mtp-tree", target, tree=True, path="")
    tree = drafter.tree
    assert tree is not None
    ids = torch.tensor([gen.encode(TEXT * 40, chat=True)[: args.context]])
    with torch.inference_mode():
        hidden = target.model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    heads = SequentialDraftCache(drafter.heads)  # type: ignore[arg-type]
    heads.add_hidden(hidden[:, :-1])
    runner.reset()
    runner.forward(ids[:, :-1])
    past, root = runner.length, ids[:, -1:]
    nodes = torch.randint(1000, (1, tree.num_nodes), generator=torch.Generator().manual_seed(0))

    def crop() -> None:
        runner.crop(past)

    kinds: dict[str, Callable[[], object]] = {
        "draft tree": lambda: heads.draft_tree(ids, tree),
        "draft chain 3": lambda: heads.draft(ids, 3),
        "forward 1": lambda: runner.forward(root),
        "forward 4": lambda: runner.forward(root.repeat(1, 4)),
        "forward 17": lambda: runner.forward(root.repeat(1, 17)),
        "tree forward 17": lambda: tree_forward(runner, tree, root, nodes),
    }
    times: dict[str, list[float]] = {name: [] for name in kinds}
    for _ in range(args.sweeps):
        for name, fn in kinds.items():
            times[name].append(
                timed(fn, crop if name.startswith(("forward", "tree")) else lambda: None)
            )
    ms = {name: round(statistics.median(t), 1) for name, t in times.items()}
    with profile() as prof:
        for _ in range(5):
            tree_forward(runner, tree, root, nodes)
            crop()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    products = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
    outside = round((total - products) / 5 / 1000, 1)  # ms a tree forward, profiled
    for name, value in ms.items():
        print(f"{name:<16} {value:7.1f} ms")
    print(f"tree forward outside matrix products: {outside} ms (profiled, 5 forwards)")
    print(json.dumps({"context": args.context, "ms": ms, "tree_outside_products_ms": outside}))


if __name__ == "__main__":
    main()
