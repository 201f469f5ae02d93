//! Causal attention over the KV cache on the GPU against the CPU reference (`#[ignore]`d):
//! NemotronH's geometry (32 query heads, 2 kv heads, head_dim 128), an odd one and the widest
//! head the kernel takes (256); prefill rows continuing a cached prefix, fresh sequences and
//! decode rows in one call (two launches: the cache write, then the flash kernel for heads up to
//! 128, the row kernel for wider ones), and decode rows alone (each in a slot of its own: one
//! launch of the row kernel, which writes the caches itself), in caches short enough for one
//! block a row and head and long enough for the row kernel to split each row's keys over
//! blocks (then a combine launch); prefills of 1 to 4096 tokens, fresh and after a cached
//! prefix, through the flash kernel.

use half::bf16;
use host::Rows;
use host::attn::{AttnRows, AttnShape, FlashKeys, Qkv, attention, attention_with, flash_tiles};
use host::cpu::attn::attend;
use kernels_gpu::attn::{ATTN_BLOCK, MAX_SPLITS, MIN_SPLIT_KEYS, smem_bytes, split_keys};
use kernels_gpu::flash::{FLASH_MAX_HEAD_DIM, FLASH_ROWS, FlashTile};
use nemotron_rs::{POISON_BF16, Rng, assert_band, assert_same, gpu, to_f64};

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

/// A block takes every key of a short cache, else a share of at most MAX_SPLITS blocks of at
/// least MIN_SPLIT_KEYS keys; the parts cover the cache, the last one not empty.
#[test]
fn split_keys_cover_the_cache_in_few_parts() {
    assert_eq!((MAX_SPLITS, MIN_SPLIT_KEYS), (32, 512));
    let mut checked = 0;
    for max_len in (1..20_000).chain([33_024, 65_536, 1 << 20, (1 << 30) - 1]) {
        let keys = split_keys(max_len);
        let splits = max_len.div_ceil(keys);
        assert!(splits <= MAX_SPLITS && (splits - 1) * keys < max_len, "max_len {max_len}: {splits} x {keys}");
        if max_len <= MIN_SPLIT_KEYS {
            assert_eq!((keys, splits), (max_len, 1));
        } else {
            assert!(keys >= MIN_SPLIT_KEYS, "max_len {max_len}: {keys} keys a block");
        }
        checked += 1;
    }
    assert_eq!(checked, 20_003);
    assert_eq!((split_keys(4160), split_keys(33_024)), (512, 1032));
}

/// Each row of `(slot, first position, rows)` runs: its slot and position.
fn rows_of(seqs: &[(i32, u32, usize)]) -> (Vec<i32>, Vec<u32>) {
    seqs.iter().flat_map(|&(sl, p0, n)| (0..n as u32).map(move |t| (sl, p0 + t))).unzip()
}

/// The reference cache write: row r's key and value (rows of `kv_heads * head_dim`) at its
/// slot and position of the caches.
fn write_rows(
    (kc, vc): (&mut [bf16], &mut [bf16]),
    (k, v): (&[bf16], &[bf16]),
    (slots, pos): (&[i32], &[u32]),
    s: AttnShape,
) {
    let kw = s.kv_heads * s.head_dim;
    for r in 0..slots.len() {
        let at = (slots[r] as usize * s.max_len + pos[r] as usize) * kw;
        kc[at..at + kw].copy_from_slice(&k[r * kw..(r + 1) * kw]);
        vc[at..at + kw].copy_from_slice(&v[r * kw..(r + 1) * kw]);
    }
}

/// The reference output of one row and its magnitude `M = sum_j w_j |v_j|` (the weights
/// applied to the values' magnitudes).
fn reference(q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>], s: AttnShape) -> (Vec<f64>, Vec<f64>) {
    let abs: Vec<Vec<f64>> = values.iter().map(|v| v.iter().map(|x| x.abs()).collect()).collect();
    let attend = |values: &[Vec<f64>]| attend(q, keys, values, s.heads, s.kv_heads, s.head_dim);
    (attend(values), attend(&abs))
}

/// Error band (atol, rtol, per M) of the attention output: the bf16 output's rounding (and f32
/// sums) within `1e-3 + (2^-8 + 1e-3) |want|`; the flash kernel also rounds each weight to bf16
/// (relative error at most 2^-9) while its sum stays f32, at most 2^-9 M each way: 2^-8 M.
fn band(flash: bool) -> (f64, f64, f64) {
    (1e-3, 1.0 / 256.0 + 1e-3, if flash { 1.0 / 256.0 } else { 0.0 })
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
        // Split rows: Nano's heads over 10 parts of 512 keys (the last of 392); the widest
        // heads (the row kernel for prefill rows too) over 3.
        AttnShape { heads: 32, kv_heads: 2, head_dim: 128, max_len: 5000 },
        AttnShape { heads: 4, kv_heads: 2, head_dim: 256, max_len: 1100 },
    ] {
        let (qw, kw, slots_n) = (s.heads * s.head_dim, s.kv_heads * s.head_dim, 4);
        // (slot, first position, rows): a prefill continuing 5 cached tokens, a fresh one,
        // decodes; then decode rows only (one at position 0, one at the cache's last, one
        // whose own key is alone in a part where the keys are split).
        let mid = (s.max_len as u32 / 2).min(MIN_SPLIT_KEYS);
        let mixed = [(2i32, 5u32, 3usize), (0, 0, 1), (3, (s.max_len - 2) as u32, 1), (1, mid, 1)];
        let decodes = [(2i32, 7u32, 1usize), (0, 0, 1), (3, (s.max_len - 1) as u32, 1), (1, mid, 1)];
        for seqs in [mixed, decodes] {
            let own = seqs == decodes;
            let (slots, pos) = rows_of(&seqs);
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
            let apart = Qkv { q: Rows::new(&dq, rows, qw), k: Rows::new(&dk, rows, kw), v: Rows::new(&dv, rows, kw) };
            attention(&gpu, s, apart, &mut dkc, &mut dvc, &arows, &mut out).unwrap();
            // Reference: write the new rows, then attend over positions 0..=pos.
            write_rows((&mut kc, &mut vc), (&k, &v), (&slots, &pos), s);
            let f = |x: &[bf16]| to_f64(x);
            let (mut want, mut mag) = (Vec::new(), Vec::new());
            for r in 0..rows {
                let base = slots[r] as usize * s.max_len * kw;
                let keys: Vec<Vec<f64>> = (0..=pos[r] as usize).map(|j| f(&kc[base + j * kw..][..kw])).collect();
                let values: Vec<Vec<f64>> = (0..=pos[r] as usize).map(|j| f(&vc[base + j * kw..][..kw])).collect();
                let (w, m) = reference(&f(&q[r * qw..][..qw]), &keys, &values, s);
                want.extend(w);
                mag.extend(m);
            }
            // The flash kernel (rows sharing slots, heads up to 128) rounds its weights to bf16.
            let flash = !own && s.head_dim <= FLASH_MAX_HEAD_DIM as usize;
            let label = format!("attention {s:?}{}", if flash { " (flash)" } else { "" });
            let got = to_f64(&gpu.download(&out).unwrap());
            compared += assert_band(&label, &got, &want, &mag, band(flash));
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
            let f = Rows::new(&df, rows, width);
            let fused = Qkv { q: f.cols(0, qw), k: f.cols(qw, kw), v: f.cols(qw + kw, kw) };
            let (mut fkc, mut fvc) = (gpu.upload(&kc0).unwrap(), gpu.upload(&vc0).unwrap());
            let mut fout = gpu.upload(&vec![POISON_BF16; rows * qw]).unwrap();
            attention(&gpu, s, fused, &mut fkc, &mut fvc, &arows, &mut fout).unwrap();
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
            assert!(err(attention(&gpu, s, apart, &mut dkc, &mut dvc, &other, &mut out2)).contains("max_len"));
            // Heads wider than the kernel's 256 channels.
            let wide = AttnShape { head_dim: 264, ..s };
            assert!(err(attention(&gpu, wide, apart, &mut dkc, &mut dvc, &arows, &mut out2)).contains("head_dim"));
            // Rows overlapping (a stride below the width); strided rows past the buffer's end;
            // keys and values of different strides; a row too few.
            let narrow = Qkv { k: Rows { stride: kw - 1, ..apart.k }, ..apart };
            let e = err(attention(&gpu, s, narrow, &mut dkc, &mut dvc, &arows, &mut out2));
            assert!(e.contains("`k`") && e.contains("row stride"), "{e}");
            let past = Qkv { q: f.cols(2 * kw + 1, qw), ..fused };
            assert!(err(attention(&gpu, s, past, &mut dkc, &mut dvc, &arows, &mut out2)).contains("`q`"));
            let mixed = Qkv { v: apart.v, ..fused };
            assert!(err(attention(&gpu, s, mixed, &mut dkc, &mut dvc, &arows, &mut out2)).contains("`v`"));
            let fewer = Qkv { q: Rows { rows: rows - 1, ..apart.q }, ..apart };
            assert!(err(attention(&gpu, s, fewer, &mut dkc, &mut dvc, &arows, &mut out2)).contains("`q`"));
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

/// Query tiles: runs of one slot at consecutive positions, cut every FLASH_ROWS rows, the
/// tiles with the most keys first; a run broken by another slot or a gap starts a new tile.
#[test]
fn flash_tiles_follow_the_runs() {
    let r = FLASH_ROWS;
    // (slot, first position, rows): a run of two full tiles and 2 rows, a single row, the same
    // slot after a gap in positions, a run of exactly one tile.
    let runs = [(0i32, 10u32, 2 * r + 2), (1, 0, 1), (0, 300 + 2 * r, 2), (2, 5, r)];
    let (slots, pos) = rows_of(&runs.map(|(sl, p0, n)| (sl, p0, n as usize)));
    let t = |row0, rows, slot, pos0| FlashTile { row0, rows, slot, pos0 };
    let mut want = vec![
        t(0, r, 0, 10),
        t(r, r, 0, 10 + r),
        t(2 * r, 2, 0, 10 + 2 * r),
        t(2 * r + 2, 1, 1, 0),
        t(2 * r + 3, 2, 0, 300 + 2 * r),
        t(2 * r + 5, r, 2, 5),
    ];
    want.sort_by_key(|t| std::cmp::Reverse(t.pos0 + t.rows));
    assert_eq!(flash_tiles(&slots, &pos), want);
    assert_eq!(want[0], t(2 * r + 3, 2, 0, 300 + 2 * r));
    assert_eq!(want.iter().map(|t| t.rows).sum::<u32>() as usize, slots.len());
}

/// Prefills through the flash kernel against the reference at NemotronH's geometry, with each
/// kernel this GPU runs (`wgmma` on sm_90a; `mma.sync` with 64 and with 32 keys a tile, the
/// kernels for sm_12x blocks): fresh
/// sequences of 1, 127, 128, 129 and 4096 tokens, and ones continuing a cached prefix (128 after
/// 37, 1000 after 200) in one call; every row of the short ones and a sample of the long ones
/// compared, with queries large enough that the softmax is peaked.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_flash_attention_prefills() {
    let gpu = gpu();
    let mut rng = Rng::new(82);
    let s = AttnShape { heads: 32, kv_heads: 2, head_dim: 128, max_len: 4200 };
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut compared = 0;
    let keys: Vec<FlashKeys> = FlashKeys::ALL.into_iter().filter(|f| f.fits(&gpu)).collect();
    assert!(!keys.is_empty(), "no flash kernel fits a block of {:?}", gpu.arch());
    let seqs = [
        vec![(0i32, 0u32, 1usize), (1, 0, 127), (2, 0, 128), (3, 0, 129), (4, 37, 128), (5, 200, 1000)],
        vec![(1, 0, 4096)],
    ];
    for (seqs, flash) in seqs.iter().flat_map(|s| keys.iter().map(move |&f| (s.clone(), f))) {
        let slots_n = 6;
        let (slots, pos) = rows_of(&seqs);
        let rows = slots.len();
        let (q, k, v) =
            (rng.bf16s(rows * qw, -3.0, 3.0), rng.bf16s(rows * kw, -1.0, 1.0), rng.bf16s(rows * kw, -1.0, 1.0));
        let mut kc = rng.bf16s(slots_n * s.max_len * kw, -1.0, 1.0);
        let mut vc = rng.bf16s(slots_n * s.max_len * kw, -1.0, 1.0);
        let (dq, dk, dv) = (gpu.upload(&q).unwrap(), gpu.upload(&k).unwrap(), gpu.upload(&v).unwrap());
        let (mut dkc, mut dvc) = (gpu.upload(&kc).unwrap(), gpu.upload(&vc).unwrap());
        let mut out = gpu.upload(&vec![POISON_BF16; rows * qw]).unwrap();
        let arows = AttnRows::new(&gpu, &slots, &pos, slots_n, s.max_len).unwrap();
        let qkv = Qkv { q: Rows::new(&dq, rows, qw), k: Rows::new(&dk, rows, kw), v: Rows::new(&dv, rows, kw) };
        attention_with(&gpu, s, qkv, (&mut dkc, &mut dvc), &arows, Some(flash), &mut out).unwrap();
        let got = to_f64(&gpu.download(&out).unwrap());
        write_rows((&mut kc, &mut vc), (&k, &v), (&slots, &pos), s);
        let mut row0 = 0;
        for &(sl, p0, n) in &seqs {
            let base = sl as usize * s.max_len * kw;
            let end = (p0 as usize + n) * kw;
            let keys: Vec<Vec<f64>> = kc[base..base + end].chunks(kw).map(to_f64).collect();
            let values: Vec<Vec<f64>> = vc[base..base + end].chunks(kw).map(to_f64).collect();
            // Every row up to 129, then every 61st and the last 3.
            let sample: Vec<usize> = (0..n).filter(|&i| n <= 129 || i % 61 == 0 || i + 3 >= n).collect();
            let (mut g, mut want, mut mag) = (Vec::new(), Vec::new(), Vec::new());
            for &i in &sample {
                let (r, j) = (row0 + i, p0 as usize + i);
                let (w, m) = reference(&to_f64(&q[r * qw..][..qw]), &keys[..=j], &values[..=j], s);
                want.extend(w);
                mag.extend(m);
                g.extend_from_slice(&got[r * qw..][..qw]);
            }
            let label = format!("flash attention ({flash:?}), {n} rows after {p0} cached");
            compared += assert_band(&label, &g, &want, &mag, band(true));
            row0 += n;
        }
        compared += assert_same("flash attention k cache", &gpu.download(&dkc).unwrap(), &kc);
        compared += assert_same("flash attention v cache", &gpu.download(&dvc).unwrap(), &vc);
    }
    println!("flash attention: {compared} values compared");
}
