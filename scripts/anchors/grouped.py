#!/usr/bin/env python3
"""The routed experts' anchor beside `cargo bench --bench moe -- experts/`: torch's grouped GEMM
(`torch._grouped_mm`), up projection, relu^2, down projection, bf16, at Nemotron-3 Nano's MoE
sizes (hidden 2688, 128 experts of 1856, top-6).

    python3 scripts/anchors/grouped.py [--tokens 16,64,256,512,1024,4096,16384] [--weights zeros]
    python3 scripts/anchors/grouped.py --check [--device cpu]

Each token picks 6 distinct experts uniformly (seeded); its rows are gathered by expert before
the timing (the gather is not timed, as the benches' dispatch is not), the experts' row counts
summed into the offsets `_grouped_mm` takes. Weights `[expert, n, k]` as the checkpoint stores
them (passed transposed, a view); zeros by default as in benches/moe.rs (the time does not
depend on the values; `--weights random` draws them). Method of `experts/b*` (timing.py):
events around one call of the three launches, 12 calls, the first dropped, median of 11; the
TFLOP/s of the two projections, `4 entries inter hidden`.

`--check` compares with a float32 reference, expert by expert, at small sizes with an expert of
no rows, one of one row and one of most rows: the offsets and layouts, not the speed.
"""

import argparse
import sys

import torch

from timing import calls_us, gpu_line

HIDDEN, EXPERTS, INTER, TOP_K = 2688, 128, 1856, 6


def route(tokens, experts, top_k, g, device):
    """Each token's `top_k` distinct experts, uniformly: `[tokens, top_k]`."""
    return torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=1).indices


def gather(x, idx, experts):
    """x's rows, one for each (token, choice), in expert order; the offsets (each expert's
    last row + 1, int32) and the row counts."""
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=experts)
    return x[order // idx.shape[1]].contiguous(), counts.cumsum(0).to(torch.int32), counts


def experts_mlp(xg, up, down, offs):
    """Every expert's rows through its up projection, relu^2, and its down projection."""
    h = torch._grouped_mm(xg, up.transpose(-2, -1), offs=offs)
    h = torch.relu(h).square()
    return torch._grouped_mm(h, down.transpose(-2, -1), offs=offs)


def check(device):
    g = torch.Generator(device=device).manual_seed(5)
    experts, hidden, inter, top_k, tokens = 8, 64, 48, 2, 37
    idx = route(tokens, experts, top_k, g, device)
    # Expert 0 gets no row, expert 1 one row (token 0's first choice), expert 2 most of them.
    idx[idx <= 1] = 2
    idx[0, 0] = 1
    idx[:, 1] = torch.where(idx[:, 0] == 2, 3, 2)
    x = torch.rand(tokens, hidden, generator=g, device=device).sub(0.5).bfloat16()
    up = torch.rand(experts, inter, hidden, generator=g, device=device).sub(0.5).div(4).bfloat16()
    down = torch.rand(experts, hidden, inter, generator=g, device=device).sub(0.5).div(4).bfloat16()
    xg, offs, counts = gather(x, idx, experts)
    got = experts_mlp(xg, up, down, offs).float()
    want, row = torch.empty_like(got), 0
    for e, c in enumerate(counts.tolist()):
        h = torch.relu(xg[row:row + c].float() @ up[e].float().T).square()
        want[row:row + c] = h.bfloat16().float() @ down[e].float().T
        row += c
    assert counts[0] == 0 and counts[1] == 1, counts
    err = ((got - want).abs() / (want.abs() + 1.0)).max().item()
    ok = row == got.shape[0] and err <= 2.0**-6
    print(f"check grouped_mm on {device}: rows per expert {counts.tolist()}, {got.numel()} outputs, "
          f"max |err| / (|want| + 1) {err:.2e}{'' if ok else '  FAILED'}")
    if not ok:
        sys.exit(1)


def bench(tokens, weights):
    print(gpu_line())
    g = torch.Generator(device="cuda").manual_seed(17)
    make = torch.zeros if weights == "zeros" else (lambda *s, **kw: torch.rand(*s, generator=g, **kw).sub(0.5).div(16))
    up = make(EXPERTS, INTER, HIDDEN, device="cuda").bfloat16()
    down = make(EXPERTS, HIDDEN, INTER, device="cuda").bfloat16()
    for n in tokens:
        idx = route(n, EXPERTS, TOP_K, g, "cuda")
        x = torch.rand(n, HIDDEN, generator=g, device="cuda").mul(2).sub(1).bfloat16()
        xg, offs, counts = gather(x, idx, EXPERTS)
        flops = 4.0 * n * TOP_K * INTER * HIDDEN
        med, p10, p90 = calls_us(lambda: experts_mlp(xg, up, down, offs))
        print(f"grouped_mm b{n:<6} {int((counts > 0).sum()):3} experts  {med:9.1f} us (median of 11, p10 {p10:.1f}, "
              f"p90 {p90:.1f}) {flops / (med * 1e-6) / 1e12:6.1f} TFLOP/s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="16,64,256,512,1024,4096,16384", help="token counts, comma-separated")
    ap.add_argument("--weights", choices=["zeros", "random"], default="zeros", help="the experts' weights")
    ap.add_argument("--check", action="store_true", help="compare with a float32 reference instead of timing")
    ap.add_argument("--device", default="cuda", help="for --check: cuda or cpu")
    a = ap.parse_args()
    if a.check:
        check(a.device)
    else:
        bench([int(t) for t in a.tokens.split(",")], a.weights)


if __name__ == "__main__":
    main()
