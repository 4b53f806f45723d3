"""What reading three hidden states costs while decoding, measured alone on the default model
(float32, 1 thread): a 2-token verify pass keeping the final state against keeping states
2, 15 and 30 (medians of 60, interleaved, after a 300-token prompt), and the heads' fusion
of a 300-token prompt's states and of one round's 2 positions. Used in docs/mtp-heads.md,
"Stage 5".

    python scripts/fusion_cost.py [HEADS_DIR]    # default: the shipped heads
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from specmtp.cache import CachedModel
from specmtp.heads_io import load_heads, shipped_heads_dir
from specmtp.models import load_model

LAYERS = (2, 15, 30)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[repeats // 2]


def main() -> None:
    torch.set_num_threads(1)
    target = load_model("default")
    heads, config = load_heads(sys.argv[1] if len(sys.argv) > 1 else shipped_heads_dir(),
                               target_model=target.model)  # fmt: skip
    heads = heads.float().eval()
    ids = torch.randint(100, 20000, (1, 300), generator=torch.Generator().manual_seed(0))
    vocab = target.model.config.vocab_size
    runners = {
        name: CachedModel(target.model, vocab_size=vocab, keep_hidden=True, hidden_layers=layers)
        for name, layers in (("final state", None), ("states 2, 15, 30", LAYERS))
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    for runner in runners.values():
        runner.forward(ids)
    for _ in range(60):
        for name, runner in runners.items():
            length = runner.length
            times[name].append(median_ms(lambda r=runner: r.forward(ids[:, :2]), 1))
            runner.crop(length)
    for name, found in times.items():
        print(f"T(2) keeping the {name}: {sorted(found)[30]:.1f} ms")
    width = config.hidden_size * len(config.feature_layers or (0,))
    with torch.no_grad():
        for positions in (300, 2):
            features = torch.randn(1, positions, width)
            cost = median_ms(lambda f=features: heads.fuse(f), 31)
            print(f"fusing {positions} positions: {cost:.2f} ms")


if __name__ == "__main__":
    main()
