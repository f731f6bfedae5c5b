# One call per LeNet layer variant, for `ncu` (not a benchmark: no timing here).
import torch
import runner._C  # noqa: F401

g = torch.Generator(device="cuda").manual_seed(0)
i = torch.arange(256, device="cuda", dtype=torch.int32)
lut = (i[:, None] * i[None, :]).contiguous()
def u(shape): return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8, device="cuda")
def w(shape): return torch.randint(-127, 128, shape, generator=g, dtype=torch.int8, device="cuda")
c1, c2, f1 = u((10000, 1, 28, 28)), u((10000, 6, 12, 12)), u((10000, 256))
w1, w2, wf = w((6, 1, 5, 5)), w((16, 6, 5, 5)), w((120, 256))
for _ in range(2):
    torch.ops.approx.lut_conv2d(c1, w1, lut, [1, 1], [0, 0], [1, 1], 1, "expanded_resident")
    torch.ops.approx.lut_conv2d(c2, w2, lut, [1, 1], [0, 0], [1, 1], 1, "expanded_smem")
    torch.ops.approx.lut_linear(f1, wf, lut, "expanded_l2")
torch.cuda.synchronize()
