#!/usr/bin/env python3
"""The state update's and the gated norm's anchor beside `cargo bench --bench ssm -- update/`
and `cargo bench --bench norm -- gated`: mamba's Triton kernels (state-spaces/mamba,
mamba_ssm/ops/triton: `selective_state_update` and the gated RMSNorm's `_layer_norm_fwd`), at
the benches' shapes.

    python3 scripts/anchors/mamba.py --mamba DIR [--check]

DIR is a checkout of state-spaces/mamba (not part of this repository: fetch it and carry it to
the GPU machine); only its three Triton files are loaded (selective_state_update.py,
layernorm_gated.py, softplus.py), not the package, whose CUDA extensions need a build.

- State update: 64 heads x 64, state 128, 8 groups, batch 1/8/64/256, f32 and bf16 state; dt, A,
  dt_bias and D per head (broadcast over the head's rows, as NemotronH has them: the kernel's
  tied form), softplus on, x, B and C column blocks of one xBC row (as the model and the bench
  pass them), the rows' slots given, no gate.
- Gated norm: rows of 4096 in 8 groups of 512, `x * silu(z)` normalized (NemotronH's
  `norm_before_gate=False`), 1/64/256/4096/16384 rows.

Method of the benches (timing.py `graph_us`): launches replayed from a CUDA graph over buffer
sets of 256 MB together (cold L2), median per launch; the bytes as the benches count them.
`--check` compares each kernel with a float32 formula at a small shape first.
"""

import argparse
import importlib.util
import sys
import types

import torch

from timing import cold_sets, gpu_line, graph_us

HEADS, HEAD_DIM, GROUPS, STATE = 64, 64, 8, 128
WIDTH, NORM_GROUPS, EPS = 4096, 8, 1e-5


def load_mamba(root):
    """(selective_state_update, _layer_norm_fwd) from mamba_ssm/ops/triton under `root`, its
    package stood in by empty modules (einops too where absent: only its references use it)."""
    if importlib.util.find_spec("einops") is None:
        sys.modules["einops"] = types.SimpleNamespace(rearrange=None, repeat=None)
    for name in ["mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"]:
        sys.modules.setdefault(name, types.ModuleType(name))
    mods = {}
    for f in ["softplus", "selective_state_update", "layernorm_gated"]:
        name = f"mamba_ssm.ops.triton.{f}"
        spec = importlib.util.spec_from_file_location(name, f"{root}/mamba_ssm/ops/triton/{f}.py")
        mods[f] = importlib.util.module_from_spec(spec)
        sys.modules[name] = mods[f]
        spec.loader.exec_module(mods[f])
    return mods["selective_state_update"].selective_state_update, mods["layernorm_gated"]._layer_norm_fwd


class Update:
    """The state update's inputs for `batch` rows, as the model passes them."""

    def __init__(self, batch, heads, head_dim, groups, state, g, random_heads=False):
        w, gn = heads * head_dim, groups * state
        dev = "cuda"
        xbc = torch.rand(batch, w + 2 * gn, generator=g, device=dev).mul(2).sub(1).bfloat16()
        self.x = xbc[:, :w].view(batch, heads, head_dim)
        self.b = xbc[:, w:w + gn].view(batch, groups, state)
        self.c = xbc[:, w + gn:].view(batch, groups, state)
        self.dt = torch.rand(batch, heads, generator=g, device=dev).mul(-3).bfloat16()
        if random_heads:  # the check: a head's parameters used for another would show
            self.a = -torch.rand(heads, generator=g, device=dev).mul(1.5).add(0.5)
            self.dt_bias = torch.rand(heads, generator=g, device=dev)
            self.d = torch.rand(heads, generator=g, device=dev).mul(2)
        else:  # as benches/ssm.rs
            self.a = torch.full((heads,), -1.0, device=dev)
            self.dt_bias = torch.full((heads,), 0.5, device=dev)
            self.d = torch.ones(heads, device=dev)
        self.slots = torch.arange(batch, dtype=torch.int32, device=dev)
        self.shape = (batch, heads, head_dim, state)

    def run(self, update, state):
        batch, heads, head_dim, n = self.shape
        return update(
            state, self.x, self.dt[:, :, None].expand(batch, heads, head_dim),
            self.a[:, None, None].expand(heads, head_dim, n), self.b, self.c,
            D=self.d[:, None].expand(heads, head_dim), dt_bias=self.dt_bias[:, None].expand(heads, head_dim),
            dt_softplus=True, state_batch_indices=self.slots)

    def want(self, state):
        """(y, new state) in float32 from `state`: docs/MATH.md section 2."""
        heads, groups = self.shape[1], self.b.shape[1]
        delta = torch.nn.functional.softplus(self.dt.float() + self.dt_bias)[:, :, None, None]
        rep = lambda t: t.float().repeat_interleave(heads // groups, dim=1)[:, :, None, :]
        s = state.float() * torch.exp(self.a[None, :, None, None] * delta) + delta * self.x.float()[..., None] * rep(self.b)
        return (s * rep(self.c)).sum(-1) + self.d[None, :, None] * self.x.float(), s


def gated_norm(norm, x, z, w, out):
    return norm(x, w, None, EPS, z=z, out=out, group_size=WIDTH // NORM_GROUPS, norm_before_gate=False,
                is_rms_norm=True)[0]


def check(update, norm):
    g = torch.Generator(device="cuda").manual_seed(3)
    ok = True
    for dtype in [torch.float32, torch.bfloat16]:
        u = Update(5, 8, 16, 2, 32, g, random_heads=True)
        state = torch.rand(u.shape, generator=g, device="cuda").sub(0.5).to(dtype)
        want_y, want_s = u.want(state)
        y = u.run(update, state)
        # y is stored in bf16 (8 bits): relative to |y| + 1; the state as its dtype stores it.
        err_y = ((y.float() - want_y).abs() / (want_y.abs() + 1)).max().item()
        err_s = (state.float() - want_s).abs().max().item()
        bound_s = 1e-2 if dtype == torch.bfloat16 else 1e-4
        good = err_y <= 2.0**-7 and err_s <= bound_s
        ok &= good
        print(f"check selective_state_update {dtype}: {y.numel()} outputs, {state.numel()} states, "
              f"max |err| / (|y| + 1) {err_y:.2e}, state max |err| {err_s:.2e}{'' if good else '  FAILED'}")
    rows, groups = 7, NORM_GROUPS
    x = torch.rand(rows, WIDTH, generator=g, device="cuda").mul(6).sub(3).bfloat16()
    z = torch.rand(rows, WIDTH, generator=g, device="cuda").mul(6).sub(3).bfloat16()
    w = torch.rand(WIDTH, generator=g, device="cuda").mul(2).sub(1).bfloat16()
    got = gated_norm(norm, x, z, w, torch.empty_like(x)).float()
    xg = (x.float() * torch.nn.functional.silu(z.float())).view(rows, groups, -1)
    want = (xg * torch.rsqrt(xg.square().mean(-1, keepdim=True) + EPS)).view(rows, WIDTH) * w.float()
    err = ((got - want).abs() / (want.abs() + 1)).max().item()
    ok &= err <= 2.0**-6
    print(f"check gated rms norm: {got.numel()} outputs, max |err| / (|want| + 1) {err:.2e}"
          f"{'' if err <= 2.0**-6 else '  FAILED'}")
    if not ok:
        sys.exit(1)


def line(name, bytes_, us):
    med, p10, p90 = us
    print(f"{name:<40} triton {bytes_:>11} B  cold {med:8.2f} us [p10 {p10:.2f}, p90 {p90:.2f}] "
          f"{bytes_ / med / 1e3:7.0f} GB/s")


def bench(update, norm):
    print(gpu_line())
    g = torch.Generator(device="cuda").manual_seed(9)
    w, gn = HEADS * HEAD_DIM, GROUPS * STATE
    for dtype, tag in [(torch.float32, "f32"), (torch.bfloat16, "bf16")]:
        for batch in [1, 8, 64, 256]:
            u = Update(batch, HEADS, HEAD_DIM, GROUPS, STATE, g)
            state_bytes = batch * HEADS * HEAD_DIM * STATE * dtype.itemsize
            bytes_ = 2 * state_bytes + batch * (2 * (w + 2 * gn + 64) + 2 * w)
            sets = cold_sets(bytes_)
            states = [torch.zeros(u.shape, dtype=dtype, device="cuda") for _ in range(sets)]
            line(f"ssm/update/{tag}/64x64x128/b{batch}", bytes_, graph_us(lambda i: u.run(update, states[i]), sets))
    wt = torch.rand(WIDTH, generator=g, device="cuda").bfloat16()
    for rows in [1, 64, 256, 4096, 16384]:
        n = rows * WIDTH
        bytes_ = 2 * n * 2 + 2 * WIDTH + 2 * n
        sets = cold_sets(bytes_)
        bufs = [[torch.rand(rows, WIDTH, generator=g, device="cuda").bfloat16() for _ in range(3)] for _ in range(sets)]
        line(f"norm/gated/bf16/{rows}x{WIDTH}", bytes_,
             graph_us(lambda i: gated_norm(norm, bufs[i][0], bufs[i][1], wt, bufs[i][2]), sets))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mamba", required=True, help="a checkout of state-spaces/mamba")
    p.add_argument("--check", action="store_true", help="compare with float32 formulas, no timing")
    args = p.parse_args()
    update, norm = load_mamba(args.mamba)
    if args.check:
        check(update, norm)
    else:
        bench(update, norm)


if __name__ == "__main__":
    main()
