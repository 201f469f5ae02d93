//! relu^2 and row gather on the GPU against direct computation (`#[ignore]`d).

use half::bf16;
use host::act::{gather, relu2};
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, to_f64};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_relu2() {
    let gpu = gpu();
    let mut rng = Rng::new(71);
    let mut compared = 0;
    for n in [1, 7, 8, 9, 4096 * 64 + 3] {
        let x = rng.bf16s(n, -4.0, 4.0);
        let mut dx = gpu.upload(&x).unwrap();
        relu2(&gpu, &mut dx, n).unwrap();
        let want: Vec<f64> = x.iter().map(|v| f64::from(v.to_f32().max(0.0).powi(2))).collect();
        compared += assert_close(&format!("relu2 {n}"), &to_f64(&gpu.download(&dx).unwrap()), &want, 0.0, 1.0 / 256.0);
    }
    println!("relu2: {compared} values compared");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gather_rows() {
    let gpu = gpu();
    let mut rng = Rng::new(72);
    let mut compared = 0;
    for (rows, width, table_rows) in [(1, 2688, 131), (17, 2688, 64), (5, 3, 4), (3, 1, 2)] {
        let table = rng.bf16s(table_rows * width, -1.0, 1.0);
        let idx: Vec<u32> = (0..rows).map(|r| ((r * 7 + 3) % table_rows) as u32).collect();
        let dt = gpu.upload(&table).unwrap();
        let mut out = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
        gather(&gpu, &dt, width, &idx, &mut out).unwrap();
        let want: Vec<bf16> = idx.iter().flat_map(|&i| table[i as usize * width..][..width].to_vec()).collect();
        compared += assert_same(&format!("gather {rows}x{width}"), &gpu.download(&out).unwrap(), &want);
        let err = gather(&gpu, &dt, width, &[table_rows as u32], &mut gpu.zeros::<bf16>(width).unwrap()).unwrap_err();
        assert!(err.to_string().contains("row indices below"), "{err}");
    }
    println!("gather: {compared} values compared");
}
