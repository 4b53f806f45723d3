"""Each Qwen2.5-Coder 1.5B target weight shape (random bfloat16 weights, 4 copies to stream
them, the LM head once), one product at 1, 8 and 16 rows: amx.c, oneDNN packed, F.linear
in padded blocks; ms, medians of 7 x 8 calls, 2 threads; max error against float32 and
row invariance. Needs amx.c built at /tmp/amx.so (gcc -O3 -shared -fPIC -march=native
-fopenmp specmtp/amx.c -o /tmp/amx.so). Output: products.txt."""
import ctypes, time, torch, statistics, sys
sys.path.insert(0,'/work/main')
from specmtp.kernels import pack_weight, packed_linear, padded_linear
torch.set_num_threads(2)
lib = ctypes.CDLL('/tmp/amx.so')
lib.specmtp_amx_packed_values.restype = ctypes.c_int64
lib.specmtp_amx_packed_values.argtypes = [ctypes.c_int64]*2
lib.specmtp_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
lib.specmtp_amx_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
print('ready', lib.specmtp_amx_ready())
def amx_pack(w):
    n,k = w.shape
    p = torch.empty(lib.specmtp_amx_packed_values(n,k), dtype=torch.bfloat16)
    lib.specmtp_amx_pack(w.data_ptr(), n, k, w.stride(0), p.data_ptr()); return p
def amx_linear(x, p, n, bias=None):
    m,k = x.shape; y = torch.empty(m,n,dtype=torch.bfloat16)
    rc = lib.specmtp_amx_linear(x.data_ptr(), m, k, p.data_ptr(), n, None if bias is None else bias.data_ptr(), y.data_ptr(), 2)
    assert rc==0, rc
    return y
shapes = [(1536,1536),(256,1536),(8960,1536),(1536,8960),(151936,1536)]
reps = {1536*1536:28*2, 256*1536:28*2, 8960*1536:28*2, 1536*8960:28, 151936*1536:1}
for n,k in shapes:
    nl = 4 if (n,k)!=(151936,1536) else 1
    ws = [torch.randn(n,k).to(torch.bfloat16)*0.02 for _ in range(nl)]  # several copies: out of cache
    ps = [amx_pack(w) for w in ws]
    qs = [pack_weight(w) for w in ws]
    x = torch.randn(32,k).to(torch.bfloat16)
    ref = (x.float() @ ws[0].float().T)
    y = amx_linear(x, ps[0], n)
    err = (y.float()-ref).abs().max().item()
    inv = all(torch.equal(amx_linear(x[:m], ps[0], n), y[:m]) and torch.equal(amx_linear(x[m:m+1], ps[0], n), y[m:m+1]) for m in range(1,32))
    res = {}
    for rows in (1,8,16):
        xs = x[:rows].contiguous()
        for name, f in (('amx', lambda i: amx_linear(xs, ps[i], n)), ('packed', lambda i: packed_linear(xs, qs[i], None)), ('pad16' , lambda i: padded_linear(xs, ws[i], None, block=16 if rows>8 else 8))):
            ts=[]
            for r in range(7):
                t=time.perf_counter()
                for i in range(8): f(i % nl)
                ts.append((time.perf_counter()-t)/8)
            res[(name,rows)] = statistics.median(ts)*1e3
    print(n,k,'maxerr %.3g'%err,'inv',inv, ' '.join(f'{a}@{r}:{v:.3f}' for (a,r),v in res.items()), 'GB/s amx@1 %.1f'%(n*k*2/res[('amx',1)]/1e6))
