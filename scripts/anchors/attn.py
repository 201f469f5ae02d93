#!/usr/bin/env python3
"""The attention prefill anchor beside `cargo bench --bench attn`: torch's
`scaled_dot_product_attention`, causal, at NemotronH's geometry (32 query heads, 2 kv heads of
128), one fresh sequence of 512 / 4096 / 16384 tokens, bf16, q / k / v / out in the
`[tokens, heads, head_dim]` rows our kernel takes (passed as strided views, nothing copied).

    python3 scripts/anchors/attn.py [--tokens 512,4096,16384] [--backends flash,cudnn]
    python3 scripts/anchors/attn.py --check [--device cpu]

Each backend is forced with `torch.nn.attention.sdpa_kernel`; the kv heads are shared by
`enable_gqa=True`, or, where a backend refuses that, expanded to 32 heads before the timing
(said on its line). Method of the Rust benches (timing.py): a CUDA graph of 64 calls over
buffer sets of at least 256 MB (cold L2), median of 31 replays per call. FLOP as benches/attn.rs
counts them: `4 heads head_dim n (n + 1) / 2` (the masked half not counted).

`--check` compares each backend (the math backend on the CPU) with a float32 reference written
from the formula at 1, 77 and 300 tokens: the layout and the head sharing, not the speed.
"""

import argparse
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from timing import cold_sets, gpu_line, graph_us

HEADS, KV_HEADS, HEAD_DIM = 32, 2, 128
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def heads_view(rows, n, heads):
    """`[n, heads * HEAD_DIM]` rows as SDPA's `[1, heads, n, HEAD_DIM]`, a view."""
    return rows.view(1, n, heads, HEAD_DIM).transpose(1, 2)


def attend(backend, q, k, v, n, expand):
    """Causal attention of the rows q `[n, 32 * 128]`, k and v `[n, 2 * 128]` (or, `expand`,
    `[n, 32 * 128]` already repeated), the output as `[1, 32, n, 128]`."""
    kv_heads = HEADS if expand else KV_HEADS
    with sdpa_kernel(BACKENDS[backend]):
        return F.scaled_dot_product_attention(
            heads_view(q, n, HEADS),
            heads_view(k, n, kv_heads),
            heads_view(v, n, kv_heads),
            is_causal=True,
            enable_gqa=not expand,
        )


def expanded(kv, n):
    """kv rows `[n, 2 * 128]` with each kv head repeated for its 16 query heads."""
    return kv.view(n, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, dim=1).reshape(n, HEADS * HEAD_DIM)


def kv_for(k, v, n, expand):
    """k and v as `attend` takes them: as they are, or `expand`ed."""
    return (expanded(k, n), expanded(v, n)) if expand else (k, v)


def pick_expand(backend, q, k, v, n):
    """False where the backend runs `enable_gqa`, True where it needs the heads expanded;
    None where it runs neither (the reason printed)."""
    for expand in (False, True):
        try:
            attend(backend, q, *kv_for(k, v, n, expand), n, expand)
            return expand
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
    print(f"sdpa {backend}: not run ({reason})")
    return None


def reference(q, k, v, n):
    """float32 causal attention from the formula: query head h reads kv head h / 16."""
    qf, kf, vf = (r.float().view(n, HEADS, HEAD_DIM) for r in (q, *kv_for(k, v, n, True)))
    scores = torch.einsum("ihd,jhd->hij", qf, kf) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("hij,jhd->hid", scores.softmax(-1), vf)


def check(device, backends):
    g = torch.Generator(device=device).manual_seed(7)
    compared = 0
    for n in (1, 77, 300):
        q, k, v = (torch.rand(n, h * HEAD_DIM, generator=g, device=device).mul(2).sub(1).bfloat16()
                   for h in (HEADS, KV_HEADS, KV_HEADS))
        want = reference(q, k, v, n)
        for backend in backends:
            expand = pick_expand(backend, q, k, v, n)
            if expand is None:
                continue
            got = attend(backend, q, *kv_for(k, v, n, expand), n, expand)[0].float()
            err = (got - want).abs().max().item()
            # bf16 output of values in [-1, 1]: half an ulp at 1 is 2^-8; P rounded to bf16 inside
            # flash kernels adds about as much again.
            ok = err <= 2.0**-6
            print(f"check sdpa {backend} n {n}: {got.numel()} outputs, max |err| {err:.2e}{'' if ok else '  FAILED'}")
            if not ok:
                sys.exit(1)
            compared += got.numel()
    if compared == 0:
        print("check: no backend ran, nothing compared  FAILED")
        sys.exit(1)


def bench(tokens, backends):
    print(gpu_line())
    qw, kw = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for n in tokens:
        flops = 4.0 * qw * n * (n + 1) / 2
        bytes_ = 2 * n * (2 * qw + 2 * kw)  # q, k, v read, out written
        sets = cold_sets(bytes_)
        g = torch.Generator(device="cuda").manual_seed(12)
        rows = lambda w: torch.rand(n, w, generator=g, device="cuda").mul(2).sub(1).bfloat16()  # noqa: E731
        q, k, v = [rows(qw) for _ in range(sets)], [rows(kw) for _ in range(sets)], [rows(kw) for _ in range(sets)]
        for backend in backends:
            expand = pick_expand(backend, q[0], k[0], v[0], n)
            if expand is None:
                continue
            kv = [kv_for(k[i], v[i], n, expand) for i in range(sets)]
            med, p10, p90 = graph_us(lambda i: attend(backend, q[i], *kv[i], n, expand), sets)
            note = " (kv heads expanded to 32)" if expand else ""
            print(f"sdpa {backend:<6} t{n:<6} {flops / 1e9:8.1f} GFLOP  cold {med:9.2f} us [p10 {p10:.2f}, p90 {p90:.2f}]"
                  f" {flops / (med * 1e-6) / 1e12:6.1f} TFLOP/s{note}")
            del kv
        del q, k, v
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,4096,16384", help="sequence lengths, comma-separated")
    ap.add_argument("--backends", default="flash,cudnn", help=f"of {','.join(BACKENDS)}, comma-separated")
    ap.add_argument("--check", action="store_true", help="compare with a float32 reference instead of timing")
    ap.add_argument("--device", default="cuda", help="for --check: cuda, or cpu (the math backend only)")
    a = ap.parse_args()
    backends = a.backends.split(",")
    if unknown := [b for b in backends if b not in BACKENDS]:
        ap.error(f"unknown backend {unknown[0]} (of {', '.join(BACKENDS)})")
    if a.check:
        check(a.device, ["math"] if a.device == "cpu" else backends)
    else:
        bench([int(t) for t in a.tokens.split(",")], backends)


if __name__ == "__main__":
    main()
