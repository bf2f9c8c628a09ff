"""Diagnostic (GPU): where do the CPU and CUDA computations of the adaptive scale differ?
Prints, for the first differing block, each stage's values on both devices."""
import torch

import taco
from test_kernels import inputs

cd = taco.get_codec("taco")
for dtype in (torch.float32, torch.bfloat16):
    x = inputs(3 * 65536 + 5, dtype, 4)
    n = x.numel()
    L = cd.padded(n)
    res = {}
    for dev in ("cpu", "cuda"):
        g = torch.zeros(L, dtype=torch.float32, device=dev)
        g[:n] = x.to(dev)
        g = g.view(-1, 256)
        ss = taco.block_sumsq(g)
        m = ss * (1.0 / 256)
        v = m + cd.eps
        sigma = torch.sqrt(v)
        alpha = torch.full_like(sigma, cd.tau) / sigma
        kern = None
        if dev == "cuda":
            buf = cd.encode(x.cuda(), 1, L)[0]
            kern = buf[L:L + 8 * (L // 256)].view(torch.float32).view(-1, 2)[:, 0].cpu()
        res[dev] = dict(ss=ss.cpu(), m=m.cpu(), v=v.cpu(), sigma=sigma.cpu(), alpha=alpha.cpu(), kernel_alpha=kern)
    for k in ("ss", "m", "v", "sigma", "alpha"):
        a, b = res["cpu"][k], res["cuda"][k]
        diff = ~((a == b) | (torch.isnan(a) & torch.isnan(b)))
        print(dtype, k, "differing blocks:", int(diff.sum()))
        if diff.any():
            i = int(diff.nonzero()[0])
            print("   block", i, "cpu", a[i].item(), hex(a[i:i + 1].view(torch.int32).item()),
                  "cuda", b[i].item(), hex(b[i:i + 1].view(torch.int32).item()))
            if k == "sigma":
                vi = res["cpu"]["v"][i:i + 1]
                print("   sqrt input", vi.item(), "float64 sqrt", vi.double().sqrt().item())
    ka, ca = res["cuda"]["kernel_alpha"], res["cpu"]["alpha"]
    print(dtype, "kernel alpha vs cpu alpha differing:", int((~((ka == ca) | torch.isnan(ka))).sum()),
          "kernel vs cuda-torch:", int((~((ka == res['cuda']['alpha']) | torch.isnan(ka))).sum()))
