#!/usr/bin/env python3
"""The FP8 linear layers' anchor beside `cargo bench --bench gemv -- fp8/`: cuBLASLt's FP8 GEMM
through torch (`torch._scaled_mm`: e4m3 x e4m3, per-tensor scales, bf16 out), at
Nemotron-3 Nano's projection shapes (Mamba in_proj and out_proj, the shared expert's up and
down, attention q) from 16 to 16384 rows.

    python3 scripts/anchors/fp8_gemm.py [--rows 16,64,128,512,4096,16384]
    python3 scripts/anchors/fp8_gemm.py --check [--device cuda]

Weights `[n, k]` e4m3 as the checkpoint stores them (passed transposed: column-major, as
cuBLASLt's FP8 GEMM wants its second operand), zeros (the time does not depend on the values,
as in benches/gemv.rs). Two timings a case, the method of `fp8/.../m16` and up (timing.py:
events around one call, 12 calls, the first dropped, median of 11): `scaled_mm` the GEMM
alone, `quant+mm` with the bf16 rows quantized by a static scale first (what `linear_fp8` in
the bench also times); TFLOP/s of `2 rows n k`.

`--check` compares `_scaled_mm` with a float32 product of the same codes and scales at a small
size: the layouts and scales, not the speed.
"""

import argparse
import sys

import torch

from timing import calls_us, gpu_line

SHAPES = [("in_proj", 10304, 2688), ("out_proj", 2688, 4096), ("shared_up", 3712, 2688),
          ("shared_down", 2688, 3712), ("q", 4096, 2688)]
E4M3 = torch.float8_e4m3fn


def linear(xq, w, sx, sw):
    """`(xq sx) (w sw)^T` in bf16: xq `[rows, k]` and w `[n, k]` e4m3 codes, scales f32 scalars."""
    return torch._scaled_mm(xq, w.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)


def check(device):
    g = torch.Generator(device=device).manual_seed(7)
    rows, n, k = 48, 80, 96
    x = torch.rand(rows, k, generator=g, device=device).sub(0.5).mul(8)
    w = torch.rand(n, k, generator=g, device=device).sub(0.5).div(4)
    sx, sw = (x.abs().max() / 448).float(), (w.abs().max() / 448).float()
    xq, wq = (x / sx).to(E4M3), (w / sw).to(E4M3)
    got = linear(xq, wq, sx, sw).float()
    want = (xq.float() * sx) @ (wq.float() * sw).T
    err = ((got - want).abs() / (want.abs() + 1.0)).max().item()
    ok = err <= 2.0**-7
    print(f"check _scaled_mm on {device}: {got.numel()} outputs, max |err| / (|want| + 1) {err:.2e}"
          f"{'' if ok else '  FAILED'}")
    if not ok:
        sys.exit(1)


def bench(rows_list):
    print(gpu_line())
    g = torch.Generator(device="cuda").manual_seed(3)
    one = torch.ones((), device="cuda")
    for name, n, k in SHAPES:
        w = torch.zeros(n, k, device="cuda").to(E4M3)
        for rows in rows_list:
            x = torch.rand(rows, k, generator=g, device="cuda").mul(2).sub(1).bfloat16()
            xq = x.to(E4M3)
            flops = 2.0 * rows * n * k
            for what, call in [("scaled_mm", lambda: linear(xq, w, one, one)),
                               ("quant+mm", lambda: linear((x / one).to(E4M3), w, one, one))]:
                med, p10, p90 = calls_us(call)
                print(f"fp8/{name}/{n}x{k}/m{rows}/{what:<9} {med:9.1f} us (median of 11, p10 {p10:.1f}, "
                      f"p90 {p90:.1f}) {flops / (med * 1e-6) / 1e12:6.1f} TFLOP/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64,128,512,4096,16384", help="row counts, comma-separated")
    ap.add_argument("--check", action="store_true", help="compare with a float32 reference instead of timing")
    ap.add_argument("--device", default="cuda", help="for --check (FP8 GEMMs need a GPU of sm_89 or newer)")
    a = ap.parse_args()
    if a.check:
        check(a.device)
    else:
        bench([int(r) for r in a.rows.split(",")])


if __name__ == "__main__":
    main()
