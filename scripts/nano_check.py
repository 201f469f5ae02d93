#!/usr/bin/env python3
"""transformers' side of the check at Nemotron-3 Nano widths (model/tests/nano_check.rs).

Reads DIR, written by that file's `write_nano_checkpoint` (config.json, model.safetensors,
prompt.json: the token ids and the positions compared), runs the whole sequence through
transformers' NemotronHForCausalLM on the GPU in float32 and then in bfloat16 (the same bf16
weights), and writes

- DIR/reference.bin: little-endian float32, the float32 run's logits at each position of
  prompt.json, then the bfloat16 run's (positions x vocab_size each);
- DIR/reference.json: versions, the tokens and positions, and per token the smallest over the
  MoE layers of the float32 router's top-k margin (between its k-th and (k+1)-th choice scores)
  over twice the largest change the bfloat16 run made to a choice score there ("tie_ratio").

    python3 scripts/nano_check.py DIR [--device cpu]

(`--device cpu` tries the script on a small checkpoint without a GPU; the check wants cuda.)

Needs torch and transformers 5.17 (NemotronH is built in; no internet, no remote code) and a
CUDA GPU that holds the float32 model (30 GB) and a one-chunk scan (its largest product is
12 GB); the host needs room for the float32 model as it loads. As for the tiny fixture
(tests/fixtures/gen_nemotron_fixture.py), every Mamba mixer's dt clamp is set to the model's
(0, inf) (transformers 5.17 clamps at time_step_min). Each run scans the whole sequence as one
chunk (exact whatever transformers does between chunks); the float32 run is repeated with the
config's 128-token chunks and the gap printed. TF32 is off, and the mamba-ssm and causal-conv1d
packages are kept out where installed (their Triton kernels would round float32 to TF32), so
both runs take transformers' PyTorch path; experts and attention run "eager".
"""

import argparse
import array
import json
import pathlib
import sys
import time

sys.modules["mamba_ssm"] = None  # import fails: transformers falls back to PyTorch
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

args = argparse.ArgumentParser(description=__doc__.split("\n")[0])
args.add_argument("dir", type=pathlib.Path, help="the folder write_nano_checkpoint wrote")
args.add_argument("--device", default="cuda")
args = args.parse_args()
ckpt, device = args.dir, args.device

if hasattr(torch.backends, "fp32_precision"):  # torch 2.9 and later
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
else:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
# float32 is float32: a matmul and a depthwise conv (the Mamba conv's) against float64.
a, b, c = (torch.randn(*shape, device=device, dtype=torch.float64) for shape in [(512, 2048), (2048, 512), (2048, 1, 4)])
checks = {
    "matmul": lambda cast: cast(a) @ cast(b),
    "conv1d": lambda cast: torch.nn.functional.conv1d(cast(b)[None], cast(c), groups=2048),
}
for name, f in checks.items():
    want, got = f(lambda t: t), f(lambda t: t.float()).double()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"float32 {name} is off by {err:.1e} of its largest value: TF32 is on"

prompt = json.loads((ckpt / "prompt.json").read_text())
tokens, positions = prompt["tokens"], prompt["positions"]
started = time.time()

model, info = AutoModelForCausalLM.from_pretrained(
    str(ckpt),
    dtype=torch.float32,
    attn_implementation="eager",
    experts_implementation="eager",
    output_loading_info=True,
)
problems = {k: v for k, v in info.items() if v}
assert not problems, f"{ckpt} does not load as transformers' NemotronH: {problems}"
model = model.to(device).eval()
config = model.config
assert config.n_group == 1, "tie_ratio below takes the top k over all experts"
name = torch.cuda.get_device_name() if device == "cuda" else device
print(f"transformers {transformers.__version__}, torch {torch.__version__}, {name}")
print(f"loaded {ckpt} in {time.time() - started:.0f} s")

layers = model.model.layers
mixers = [layer.mixer for layer in layers if layer.block_type == "linear_attention"]
routers = [layer.mixer.gate for layer in layers if layer.block_type == "moe"]
for m in mixers:
    m.time_step_limit = (0.0, float("inf"))

router_logits = []  # per MoE layer, [tokens, experts], of the last run
for r in routers:
    r.register_forward_hook(lambda module, args, out: router_logits.append(out[0].float()))
branch_rms = []  # per layer: RMS of the residual stream after it, of what it added
for layer in layers:
    layer.register_forward_hook(
        lambda module, args, out: branch_rms.append(
            (out.float().pow(2).mean().sqrt().item(), (out - args[0]).float().pow(2).mean().sqrt().item())
        )
    )

ids = torch.tensor([tokens], device=device)
keep = torch.tensor(positions, device=device)


def run(chunk):
    """Logits at the positions (float32, on the CPU) with Mamba chunks of `chunk` tokens."""
    for m in mixers:
        m.chunk_size = chunk
    router_logits.clear()
    branch_rms.clear()
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, logits_to_keep=keep).logits[0].float().cpu()


def choice_scores(logits, router):
    """What the router ranks experts by: sigmoid scores plus the correction bias."""
    return logits.sigmoid() + router.e_score_correction_bias.float()


def gaps(a, b):
    d = (a - b).double()
    return f"largest {d.abs().max().item():.3e}, RMS {d.pow(2).mean().sqrt().item():.3e}"


f32 = run(len(tokens))
scores32 = [choice_scores(lg, r) for lg, r in zip(router_logits, routers)]
print("per layer, RMS of the residual stream and of the layer's output (float32):")
for i, (stream, added) in enumerate(branch_rms):
    print(f"  {i:2} {layers[i].block_type:17} {stream:.3f} {added:.3f}")
print(f"float32, 128-token chunks against one chunk: {gaps(run(config.chunk_size), f32)}")

model = model.to(torch.bfloat16)
bf16 = run(len(tokens))
print(f"bfloat16 against float32: {gaps(bf16, f32)}")

k = config.num_experts_per_tok
ratios, flips = [], 0
for s32, lg, r in zip(scores32, router_logits, routers):
    s16 = choice_scores(lg, r)
    top = s32.topk(k + 1, dim=-1).values
    noise = (s16 - s32).abs().amax(dim=-1)
    ratios.append((top[:, k - 1] - top[:, k]) / (2 * noise).clamp_min(1e-30))
    chosen = [s.topk(k, dim=-1).indices.sort(dim=-1).values for s in (s32, s16)]
    flips += (chosen[0] != chosen[1]).any(dim=-1).sum().item()
tie_ratio = torch.stack(ratios).amin(dim=0).clamp_max(1e30).tolist()
print(
    f"routers: {flips} of {len(tokens) * len(routers)} choices differ in bfloat16; "
    f"{sum(t < 1 for t in tie_ratio)} tokens have a margin under bfloat16's noise, {sum(t < 2 for t in tie_ratio)} under twice it"
)

assert sys.byteorder == "little"
with open(ckpt / "reference.bin", "wb") as f:
    for logits in (f32, bf16):
        array.array("f", logits.flatten().tolist()).tofile(f)
header = {
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "device": name,
    "tokens": tokens,
    "positions": positions,
    "vocab": f32.shape[-1],
    "tie_ratio": tie_ratio,
}
(ckpt / "reference.json").write_text(json.dumps(header))
print(f"wrote {ckpt}/reference.json and reference.bin ({len(positions)} positions) in {time.time() - started:.0f} s")
