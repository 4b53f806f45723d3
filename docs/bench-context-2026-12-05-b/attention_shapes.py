# The attention micro-benchmark of docs/mtp-heads.md ("Drafting at long contexts"): run with a
# checkout of 21504b0 (the reverted attend_after) at /tmp/wt_new. The packed SDPA here
# concatenates past and new keys; mtp_cache.py writes them into its buffer instead.
import torch, time, torch.nn.functional as F, sys
sys.path.insert(0, '/tmp/wt_new')
from specmtp.heads import attend_after
torch.set_num_threads(1)
H,d=4,144
def packed(q,k,v,past):
    pk,pv=past; rows,_,n,_=q.shape; m=rows  # B=1
    qq = q.permute(1,0,2,3).reshape(1,H,m*n,d)
    kk = torch.cat([pk, k.permute(1,0,2,3).reshape(1,H,m*n,d)],2)
    vv = torch.cat([pv, v.permute(1,0,2,3).reshape(1,H,m*n,d)],2)
    own = torch.block_diag(*[torch.ones(n,n,dtype=torch.bool).tril()]*m)
    mask = torch.cat([torch.ones(m*n,pk.shape[2],dtype=torch.bool), own],1)
    out = F.scaled_dot_product_attention(qq,kk,vv,attn_mask=mask)
    return out.reshape(1,H,m,n,d).permute(2,0,1,3,4).reshape(m,H,n,d)
def f32(q,k,v,past):
    return attend_after(q.float(),k.float(),v.float(),(past[0].float(),past[1].float())).to(q.dtype)
dt=torch.bfloat16
for base in [100,1000,4000]:
  for m,n in [(1,2),(5,5)]:
    buf_k = torch.randn(1,H,base+300,d,dtype=dt); buf_v=torch.randn(1,H,base+300,d,dtype=dt)
    q,k,v=[torch.randn(m,H,n,d,dtype=dt) for _ in range(3)]
    ref = attend_after(q.float(),k.float(),v.float(),(buf_k[:,:,:base].float(),buf_v[:,:,:base].float()))
    print(base,m,n, "packed err", (packed(q,k,v,(buf_k[:,:,:base],buf_v[:,:,:base])).float()-ref).abs().max().item())
    for name,f in [("attend_after bf16",attend_after),("attend_after f32",f32),("packed sdpa",packed)]:
        s=time.perf_counter()
        for L in range(base,base+200): f(q,k,v,(buf_k[:,:,:L],buf_v[:,:,:L]))
        print("  ",name, "%.3f ms"%((time.perf_counter()-s)/200*1e3))
