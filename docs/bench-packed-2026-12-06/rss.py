import resource, torch, sys
torch.set_num_threads(2)
from specmtp.api import SpecGenerator
Q = "/root/.cache/specmtp/qwen2.5-coder/"
g = SpecGenerator(Q + "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", draft=Q + "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf#int8#nodes=6", dtype=torch.bfloat16)
r1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
c = g.generate("Write a Python function that reverses a string.", chat=True, max_new_tokens=16, gamma=4)
r2 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
import specmtp.kernels as k
print("peak RSS after load %.2f GB, after generate %.2f GB, target packed %.2f GB" % (r1, r2, getattr(k, "packed_bytes", lambda m: 0)(g.target.model) / 2**30), repr(c.text[:40]))
