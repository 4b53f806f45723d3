import torch
from specmtp.data import DistillCache
from specmtp.train_joint import JointModule, heldout_agreement, trainable_trunk
torch.set_num_threads(2)
for spec in ("default", "/root/runs-joint/joint/model"):
    trunk = trainable_trunk(spec)
    if True:
        m = JointModule(trunk.model, torch.nn.Identity(), (2, 15, 30))
        a = heldout_agreement(m, DistillCache.open(__import__("pathlib").Path("/root/runs-joint/frozen/data")), batch_size=8, seq_len=320, heldout_fraction=0.1, labels=lambda b: None)
    print(spec, a)
