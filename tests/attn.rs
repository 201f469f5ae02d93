//! Causal attention over the KV cache on the GPU against the CPU reference (`#[ignore]`d):
//! NemotronH's geometry (32 query heads, 2 kv heads, head_dim 128), an odd one and the widest
//! head the kernel takes (256); prefill rows continuing a cached prefix, fresh sequences and
//! decode rows in one call (two launches), and decode rows alone (each in a slot of its own:
//! one launch, which writes the caches itself).

use half::bf16;
use host::attn::{AttnRows, AttnShape, attention};
use host::cpu::attn::attend;
use kernels_gpu::attn::{ATTN_BLOCK, smem_bytes};
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, to_f64};

/// The shared memory an attention launch asks for never wraps (it did in u32 for caches of
/// 2^30 positions): the exact size below that, u32::MAX (which every launch refuses) above.
#[test]
fn attention_shared_memory_does_not_wrap() {
    let warps = ATTN_BLOCK / 32;
    assert_eq!(smem_bytes(128, 256), (256 + warps + warps * 128) * 4);
    assert_eq!(smem_bytes(256, 4096), (4096 + warps + warps * 256) * 4);
    for max_len in [1 << 30, (1 << 31) - 1, u32::MAX] {
        assert_eq!(smem_bytes(128, max_len), u32::MAX, "max_len {max_len}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_attention_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(81);
    let mut compared = 0;
    for s in [
        AttnShape { heads: 32, kv_heads: 2, head_dim: 128, max_len: 256 },
        AttnShape { heads: 6, kv_heads: 3, head_dim: 5, max_len: 40 },
        AttnShape { heads: 4, kv_heads: 2, head_dim: 256, max_len: 64 },
    ] {
        let (qw, kw, slots_n) = (s.heads * s.head_dim, s.kv_heads * s.head_dim, 4);
        // (slot, first position, rows): a prefill continuing 5 cached tokens, a fresh one,
        // decodes; then decode rows only (one at position 0, one at the cache's last).
        let mixed = [(2i32, 5u32, 3usize), (0, 0, 1), (3, (s.max_len - 2) as u32, 1), (1, 17, 1)];
        let decodes = [(2i32, 7u32, 1usize), (0, 0, 1), (3, (s.max_len - 1) as u32, 1), (1, 17, 1)];
        for seqs in [mixed, decodes] {
            let own = seqs == decodes;
            let (slots, pos): (Vec<i32>, Vec<u32>) =
                seqs.iter().flat_map(|&(sl, p0, n)| (0..n as u32).map(move |t| (sl, p0 + t))).unzip();
            let rows = slots.len();
            let (q, k, v) =
                (rng.bf16s(rows * qw, -1.0, 1.0), rng.bf16s(rows * kw, -1.0, 1.0), rng.bf16s(rows * kw, -1.0, 1.0));
            let mut kc = rng.bf16s(slots_n * s.max_len * kw, -1.0, 1.0);
            let mut vc = rng.bf16s(slots_n * s.max_len * kw, -1.0, 1.0);
            // The rows' own cache positions poisoned: a launch that read them before writing
            // them (rather than the step's k and v) would give NaN.
            for (&sl, &p) in slots.iter().zip(&pos) {
                let at = (sl as usize * s.max_len + p as usize) * kw;
                kc[at..at + kw].fill(POISON_BF16);
                vc[at..at + kw].fill(POISON_BF16);
            }
            let (kc0, vc0) = (kc.clone(), vc.clone());
            let (dq, dk, dv) = (gpu.upload(&q).unwrap(), gpu.upload(&k).unwrap(), gpu.upload(&v).unwrap());
            let (mut dkc, mut dvc) = (gpu.upload(&kc).unwrap(), gpu.upload(&vc).unwrap());
            let mut out = gpu.upload(&vec![POISON_BF16; rows * qw]).unwrap();
            // Rows written over in place (as a replayed graph reads them) before the launch.
            let stale: Vec<u32> = pos.iter().map(|&p| (p + 1) % s.max_len as u32).collect();
            let mut arows = AttnRows::new(&gpu, &slots, &stale, slots_n, s.max_len).unwrap();
            arows.set(&gpu, &slots, &pos).unwrap();
            attention(&gpu, s, (&dq, qw), (&dk, &dv, kw), &mut dkc, &mut dvc, &arows, &mut out).unwrap();
            // Reference: write the new rows, then attend over positions 0..=pos.
            for r in 0..rows {
                let at = (slots[r] as usize * s.max_len + pos[r] as usize) * kw;
                kc[at..at + kw].copy_from_slice(&k[r * kw..(r + 1) * kw]);
                vc[at..at + kw].copy_from_slice(&v[r * kw..(r + 1) * kw]);
            }
            let f = |x: &[bf16]| to_f64(x);
            let mut want = Vec::new();
            for r in 0..rows {
                let base = slots[r] as usize * s.max_len * kw;
                let keys: Vec<Vec<f64>> = (0..=pos[r] as usize).map(|j| f(&kc[base + j * kw..][..kw])).collect();
                let values: Vec<Vec<f64>> = (0..=pos[r] as usize).map(|j| f(&vc[base + j * kw..][..kw])).collect();
                want.extend(attend(&f(&q[r * qw..][..qw]), &keys, &values, s.heads, s.kv_heads, s.head_dim));
            }
            let label = format!("attention {s:?}");
            compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, 1e-3, 1.0 / 256.0 + 1e-3);
            compared += assert_same(&format!("{label} k cache"), &gpu.download(&dkc).unwrap(), &kc);
            compared += assert_same(&format!("{label} v cache"), &gpu.download(&dvc).unwrap(), &vc);
            // The same rows as column blocks of one buffer [rows, qw + 2 kw] (a fused q/k/v
            // projection's output), over the caches as they were: the same output and caches, bit
            // for bit.
            let width = qw + 2 * kw;
            let fused: Vec<bf16> = (0..rows)
                .flat_map(|r| q[r * qw..][..qw].iter().chain(&k[r * kw..][..kw]).chain(&v[r * kw..][..kw]).copied())
                .collect();
            let df = gpu.upload(&fused).unwrap();
            let (fq, fk, fv) = (df.slice(..), df.slice(qw..), df.slice(qw + kw..));
            let (mut fkc, mut fvc) = (gpu.upload(&kc0).unwrap(), gpu.upload(&vc0).unwrap());
            let mut fout = gpu.upload(&vec![POISON_BF16; rows * qw]).unwrap();
            attention(&gpu, s, (&fq, width), (&fk, &fv, width), &mut fkc, &mut fvc, &arows, &mut fout).unwrap();
            compared +=
                assert_same(&format!("{label} strided"), &gpu.download(&fout).unwrap(), &gpu.download(&out).unwrap());
            compared += assert_same(&format!("{label} strided k cache"), &gpu.download(&fkc).unwrap(), &kc);
            compared += assert_same(&format!("{label} strided v cache"), &gpu.download(&fvc).unwrap(), &vc);
            fn err<T>(r: host::Result<T>) -> String {
                r.err().map(|e| e.to_string()).unwrap_or_default()
            }
            assert!(
                err(AttnRows::new(&gpu, &[0, 0], &[3, 3], slots_n, s.max_len))
                    .contains("one row per slot and position")
            );
            assert!(err(arows.set(&gpu, &[0], &[3])).contains("`slots`"));
            let other = AttnRows::new(&gpu, &slots, &pos, slots_n, s.max_len + 1).unwrap();
            let mut out2 = gpu.zeros::<bf16>(rows * qw).unwrap();
            let (q1, kv1) = ((&dq, qw), (&dk, &dv, kw));
            assert!(err(attention(&gpu, s, q1, kv1, &mut dkc, &mut dvc, &other, &mut out2)).contains("max_len"));
            // Heads wider than the kernel's 256 channels.
            let wide = AttnShape { head_dim: 264, ..s };
            assert!(err(attention(&gpu, wide, q1, kv1, &mut dkc, &mut dvc, &arows, &mut out2)).contains("head_dim"));
            // Rows overlapping (a stride below the width); strided rows past the buffer's end.
            let narrow = (&dk, &dv, kw - 1);
            assert!(err(attention(&gpu, s, q1, narrow, &mut dkc, &mut dvc, &arows, &mut out2)).contains("`kv_stride`"));
            let (short, wider) = (df.slice(..(rows - 1) * width + qw - 1), (&fk, &fv, width));
            assert!(
                err(attention(&gpu, s, (&short, width), wider, &mut dkc, &mut dvc, &arows, &mut out2)).contains("`q`")
            );
            if own {
                // Rows written in place keep each in a slot of its own (the recorded step has
                // no cache-write launch).
                let e = err(arows.set(&gpu, &[0, 0, 3, 1], &[1, 2, 3, 4]));
                assert!(e.contains("each row in a slot of its own"), "{e}");
            }
        }
    }
    println!("attention: {compared} values compared");
}
