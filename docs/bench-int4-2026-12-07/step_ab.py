"""The 0.5B draft's 7-node #int4 tree with this commit's draft step and with the one before
(int4.c as of f66c930, read from git, and lean.py's step as then: fresh product outputs,
torch's silu * up), one process, one loaded 1.5B target, in turn on training
instructions (96 tokens, γ = 3, greedy); outputs checked against each other. Run from the
repository root: python docs/bench-int4-2026-12-07/step_ab.py [PROMPTS]"""
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from specmtp import native
from specmtp.api import SpecGenerator
from specmtp.int4 import Int4Product
from specmtp.invariant import _native_attention
from specmtp.models import load_model

torch.set_num_threads(2)
Q = os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/")
D = Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


def old_kernel():
    """specmtp_int4_linear compiled from int4.c at f66c930 (same records, same arguments)."""
    source = Path(tempfile.mkdtemp()) / "int4.c"
    source.write_bytes(subprocess.run(["git", "show", "f66c930:specmtp/int4.c"], check=True,
                                      capture_output=True).stdout)
    compiler = os.environ.get("CC") or "cc"
    library = native._build(compiler, source, (*native.FLAGS, "-fopenmp"))
    function = ctypes.CDLL(str(library)).specmtp_int4_linear
    function.argtypes, function.restype = native._INT4_ARGS, ctypes.c_int
    return function


def old_layer_step(self, index, x, delta, h, rotary, cache, attention_mask):
    """lean.py's LeanForward.layer_step at f66c930."""
    layer, n = self.layers[index], x.shape[0]
    heads, kv_heads, d = self.heads, self.kv_heads, self.head_dim
    kv_dtype = self.embed.weight.dtype
    self._add_norm(x, delta, layer.input_norm, h)
    qkv = layer.qkv(h)
    q = torch.empty(n, heads, d)
    k = torch.empty(1, kv_heads, n, d, dtype=kv_dtype)
    v = torch.empty_like(k)
    cos, sin = rotary
    self.kernels.rotary(
        qkv.data_ptr(), n, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
        q.data_ptr(), k.data_ptr(), v.data_ptr(), int(kv_dtype == torch.bfloat16),
    )
    keys, values = cache.update(k, v, index)
    query = q.transpose(0, 1)[None]
    out = _native_attention(self.attend, query, keys, values, attention_mask, self.scale)
    self._add_norm(x, layer.o(out.view(n, heads * d)), layer.post_norm, h)
    gate_up = layer.gate_up(h)
    gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
    return layer.down(F.silu(gate) * up)


target = load_model(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", dtype=torch.bfloat16)
gens = {name: SpecGenerator(target, draft=f"{D}#int4#nodes=7", dtype=torch.bfloat16) for name in ("before", "now")}
leans = {name: g.decoder.drafter.runner.lean for name, g in gens.items()}
assert all(lean is not None for lean in leans.values()) and leans["before"] is not leans["now"]
kernel = old_kernel()
before = leans["before"]
before.layer_step = types.MethodType(old_layer_step, before)
products = [p for layer in before.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
products += [m.product for m in gens["before"].decoder.drafter.runner.model.modules() if hasattr(m, "product") and isinstance(m.product, Int4Product)]
for p in products:
    p.kernel = kernel
count = int(sys.argv[1]) if len(sys.argv) > 1 else 6
rows = [json.loads(line) for line in open("../shared/train_prompts/self_instruct_en/seed_tasks.jsonl")][:count]
for i, prompt in enumerate(r["instruction"] for r in rows):
    texts = {}
    order = ("before", "now") if i % 2 == 0 else ("now", "before")
    for name in order:
        start = time.perf_counter()
        c = gens[name].generate(prompt, chat=True, max_new_tokens=96, gamma=3)
        s, texts[name] = c.stats, c.text
        rounds = sum(s.verify_sizes.values())
        print(f"{name}: {time.perf_counter() - start:.2f}s draft {s.draft_s:.2f} verify {s.verify_s:.2f} "
              f"rounds {rounds} ms/round draft {1000 * s.draft_s / rounds:.1f} "
              f"verify {1000 * s.verify_s / rounds:.1f} tau {s.mean_accepted_tokens:.2f}", flush=True)
    print("same output:", texts["before"] == texts["now"], flush=True)
