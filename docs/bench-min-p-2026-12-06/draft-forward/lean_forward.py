import time, statistics, torch, os, sys
import torch.nn.functional as F
torch.set_num_threads(2)
from specmtp.models import load_model
from specmtp.int8 import use_int8_products, Int8Linear
Q=os.path.expanduser("~/.cache/specmtp/qwen2.5-coder/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
d = load_model(Q, dtype=torch.bfloat16)
m = d.model
use_int8_products(m)
cfg = m.config
L = cfg.num_hidden_layers; Hq = cfg.num_attention_heads; Hkv = cfg.num_key_value_heads; D = cfg.hidden_size // Hq
inv = m.model.rotary_emb.inv_freq.float(); asc = m.model.rotary_emb.attention_scaling
eps = cfg.rms_norm_eps
def prod(lin):
    p = lin.product; return lambda x: torch.ops.quantized.linear_dynamic(x, p.packed, p.reduce_range)
layers = []
for lay in m.model.layers:
    a = lay.self_attn
    layers.append(dict(n1=lay.input_layernorm.weight.float(), n2=lay.post_attention_layernorm.weight.float(),
        q=prod(a.q_proj), k=prod(a.k_proj), v=prod(a.v_proj), o=prod(a.o_proj),
        g=prod(lay.mlp.gate_proj), u=prod(lay.mlp.up_proj), dn=prod(lay.mlp.down_proj)))
normw = m.model.norm.weight.float(); head = prod(m.lm_head); emb = m.model.embed_tokens.weight
cap = 4096
K = torch.zeros(L, Hkv, cap, D); V = torch.zeros(L, Hkv, cap, D)
length = 0
def rms(x, w): return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
def rot(x, cos, sin):  # x [H, n, D]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return x * cos + torch.cat((-x2, x1), -1) * sin
def fwd(tokens, mask=None, pos=None, last_only=False):
    global length
    n = tokens.shape[0]
    if pos is None: pos = torch.arange(length, length + n)
    f = pos[:, None].float() * inv; e = torch.cat((f, f), -1); cos = e.cos()*asc; sin = e.sin()*asc
    h = emb[tokens].float()
    end = length + n
    for i, w in enumerate(layers):
        r = rms(h, w["n1"])
        q = w["q"](r).view(n, Hq, D).transpose(0, 1); k = w["k"](r).view(n, Hkv, D).transpose(0, 1); v = w["v"](r).view(n, Hkv, D).transpose(0, 1)
        q = rot(q, cos, sin); k = rot(k, cos, sin)
        K[i, :, length:end] = k; V[i, :, length:end] = v
        att = F.scaled_dot_product_attention(q[None], K[i, :, :end][None], V[i, :, :end][None], attn_mask=mask, enable_gqa=True)
        h = h + w["o"](att[0].transpose(0, 1).reshape(n, Hq * D))
        r = rms(h, w["n2"])
        h = h + w["dn"](F.silu(w["g"](r)) * w["u"](r))
    length = end
    if last_only: h = h[-1:]
    return head(rms(h, normw))
def t(f, n=15):
    xs=[]
    for _ in range(n):
        t0=time.perf_counter(); f(); xs.append(time.perf_counter()-t0)
    return statistics.median(xs)*1000
with torch.inference_mode():
    # correctness vs HF on a chain
    from specmtp.cache import CachedModel
    r = CachedModel(m, vocab_size=151936, name="d")
    ctx = torch.randint(100, 20000, (1, 400))
    ref = r.forward(ctx, last_only=True)[0,-1].float()
    mine = fwd(ctx[0], mask=None if False else torch.ones(400,400,dtype=torch.bool).tril(), last_only=True)[0]
    print("max diff", (ref-mine).abs().max().item(), "argmax", ref.argmax().item(), mine.argmax().item())
    past = length
    def step(rows):
        def f():
            global length
            mask = torch.ones(rows, past+rows, dtype=torch.bool)
            fwd(torch.randint(100,20000,(rows,)), mask=mask[None,None] if rows>1 else None, pos=torch.full((rows,),past)); length = past
        return f
    for rows in (1,2,4):
        print(rows, "lean %.1f ms" % t(step(rows)))
