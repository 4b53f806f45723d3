from pathlib import Path
import torch
from specmtp.data import DistillCache
from specmtp.heads_io import load_heads, shipped_heads_dir
from specmtp.models import load_model
from specmtp.train import TrainConfig, evaluate
torch.set_num_threads(1)
target = load_model("default", dtype=torch.bfloat16)
heads, _ = load_heads(shipped_heads_dir(), target_model=target.model)
cache = DistillCache.open(Path("/root/runs-joint/frozen/data"))
cfg = TrainConfig(sources=(Path("x"),), out=Path("/tmp/x"), kind="sequential", num_heads=3, batch_size=8, seq_len=320, heldout_fraction=0.1, objective="kl", feature_layers=(2, 15, 30))
print(evaluate(heads.float(), cache, cfg))
