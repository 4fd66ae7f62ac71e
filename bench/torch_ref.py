"""torch on the same GPU as wisp's benchmark, for the side-by-side ratios of issue #11.

Kernel-only times (CUDA events around the product, after warm-up) of fp32 products with TF32
off and fp16 products, at 4096^3 and at the shapes of the golden models' weights for
t = 1, 16, 128, 512; and the device-to-device copy rate (bytes read plus written), the HBM
figure the GEMV target is a fraction of. Prints one line per measurement.
"""

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")


def timed(f, reps):
    for _ in range(3):
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        f()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def product(t, n_out, n_in, dtype):
    x = torch.randn(t, n_in, device=dev, dtype=dtype)
    w = torch.randn(n_out, n_in, device=dev, dtype=dtype)
    flops = 2.0 * t * n_out * n_in
    reps = max(3, min(200, int(2e12 / flops)))
    return flops / timed(lambda: x @ w.T, reps) / 1e12


print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
for dtype in (torch.float32, torch.float16):
    print(f"{dtype} 4096^3: {product(4096, 4096, 4096, dtype):.1f} TFLOP/s")
shapes = {
    "gemma3-270m": [(1024, 640), (256, 640), (640, 1024), (2048, 640), (640, 2048), (262144, 640)],
    "qwen2.5-0.5b": [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)],
}
for model, ws in shapes.items():
    for n_out, n_in in ws:
        for t in (1, 16, 128, 512):
            r32 = product(t, n_out, n_in, torch.float32)
            r16 = product(t, n_out, n_in, torch.float16)
            print(f"{model} [{n_out}, {n_in}] t={t}: fp32 {r32 * 1e3:.1f} GFLOP/s, fp16 {r16 * 1e3:.1f} GFLOP/s")
n = 1 << 30
a = torch.empty(n, dtype=torch.uint8, device=dev)
b = torch.empty_like(a)
secs = timed(lambda: b.copy_(a), 20)
print(f"device-to-device copy of 1 GiB: {2 * n / secs / 1e12:.2f} TB/s (read + write)")
