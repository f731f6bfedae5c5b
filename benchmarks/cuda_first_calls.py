"""What a process pays the first time it touches the GPU: the CUDA context, cuDNN's first convolution,
cuBLAS's first matmul (each synchronised), then the same calls again.

    python benchmarks/cuda_first_calls.py      # on the GPU machine; run it a few times (the first run
                                               # also reads the libraries from disk)

approx-run starts these in a background thread for the GPU commands (runner.gpus.warm_up_cuda)."""
import time

import torch
import torch.nn.functional as F


def main() -> None:
    marks = [time.perf_counter()]

    def mark():
        torch.cuda.synchronize()
        marks.append(time.perf_counter())

    torch.zeros(1, device="cuda")
    mark()
    x, w = torch.randn(1000, 1, 28, 28, device="cuda"), torch.randn(6, 1, 5, 5, device="cuda")
    F.conv2d(x, w)
    mark()
    a, b = torch.randn(1000, 256, device="cuda"), torch.randn(120, 256, device="cuda")
    F.linear(a, b)
    mark()
    F.conv2d(x, w)
    F.linear(a, b)
    mark()
    spans = [t1 - t0 for t0, t1 in zip(marks, marks[1:])]
    print("context {:.3f} s, first conv2d {:.3f} s, first linear {:.3f} s, both again {:.4f} s".format(*spans))


if __name__ == "__main__":
    main()
