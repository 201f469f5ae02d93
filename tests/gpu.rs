//! Opening the device: a clear error, never a panic, where there is no driver or no such GPU.

use host::{Arch, Error, Gpu};

#[test]
fn a_missing_device_is_an_error_not_a_panic() {
    match Gpu::new(1 << 20) {
        Err(e @ (Error::NoDriver | Error::NoDevice { .. })) => println!("Gpu::new(2^20): {e}"),
        Err(e) => panic!("unexpected error kind: {e}"),
        Ok(_) => panic!("device 2^20 cannot exist"),
    }
}

#[test]
fn device_zero_opens_or_says_why() {
    match Gpu::new(0) {
        Ok(gpu) => assert!(Arch::ALL.contains(&gpu.arch())),
        Err(e @ Error::NoDriver) => assert!(e.to_string().contains("install the NVIDIA driver"), "{e}"),
        Err(e) => panic!("device 0 present but unusable: {e}"),
    }
}

/// Graph capture: host copies (the timeline's too) and a nested capture are refused while
/// recording (the capture returns that error), and a capture whose work panics still ends, so
/// the device takes copies and records and replays graphs again.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_capture_refuses_host_copies_and_ends_after_a_panic() {
    let gpu = nemotron_rs::gpu();
    let mut rng = nemotron_rs::Rng::new(11);
    let values: Vec<f32> = (0..4099).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let src = gpu.upload(&values).unwrap();
    let err = gpu.capture(|| gpu.download(&src).map(|_| ())).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InCapture(_)), "{err}");
    let err = gpu.capture(|| gpu.capture(|| Ok::<(), Error>(())).map(|_| ())).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InCapture(_)), "{err}");
    // Reading the timeline copies from the device too; outside a capture, a build without
    // NEMO_TIMELINE has none.
    let err = gpu.capture(|| gpu.timeline().map(|_| ())).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InCapture(_)), "{err}");
    assert!(gpu.timeline().unwrap().is_none(), "a timeline in a build without NEMO_TIMELINE");
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        gpu.capture(|| -> host::Result<()> { panic!("work that panics while it is recorded") })
    }));
    assert!(unwound.is_err(), "the panic reaches the caller");
    let mut dst = gpu.zeros::<f32>(values.len()).unwrap();
    let graph = gpu.capture(|| gpu.copy(&src, &mut dst)).unwrap();
    assert_eq!(gpu.download(&dst).unwrap(), vec![0.0; values.len()], "recorded, not run");
    graph.replay().unwrap();
    let n = nemotron_rs::assert_same("replayed copy", &gpu.download(&dst).unwrap(), &values);
    println!("capture: {n} values compared after a refused copy, a refused nested capture and a panic");
}

/// `download_with`: the values uploaded, through its page-locked buffer as it grows (a larger
/// copy after a small one, then a small one again, of another type), refused while recording.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_download_with_reads_what_was_uploaded() {
    let gpu = nemotron_rs::gpu();
    let mut rng = nemotron_rs::Rng::new(12);
    let small: Vec<f32> = (0..4099).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
    let large = rng.bf16s(300_001, -2.0, 2.0);
    let (ds, dl) = (gpu.upload(&small).unwrap(), gpu.upload(&large).unwrap());
    let mut n = 0;
    for _ in 0..2 {
        n += nemotron_rs::assert_same("small", &gpu.download_with(&ds, |v| v.to_vec()).unwrap(), &small);
        let bits = |v: &[half::bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        n += nemotron_rs::assert_same("large", &gpu.download_with(&dl, bits).unwrap(), &bits(&large));
    }
    let err = gpu.capture(|| gpu.download_with(&ds, |_| ())).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InCapture(_)), "{err}");
    assert_eq!(n, 2 * (small.len() + large.len()));
    println!("download_with: {n} values compared");
}

/// `upload_bytes_into`: bytes land where asked, across the staging buffers' chunks (a copy of
/// 2.5 stages, then a small one reusing them, then an empty one) and at an offset into a
/// larger buffer whose other elements stay as they were; a destination too small and a copy
/// inside a capture are refused.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_upload_bytes_into_writes_what_was_given() {
    let gpu = nemotron_rs::gpu();
    let seed = 0x5EED_u64;
    let bytes = |n: usize, salt: u64| -> Vec<u8> {
        (0..n as u64).map(|i| ((i ^ salt).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(seed) >> 56) as u8).collect()
    };
    let stage = host::UPLOAD_STAGE_BYTES;
    let mut n = 0;
    for (len, at, salt) in [(5 * stage / 2 + 6, 3usize, 1u64), (1000, 0, 2), (0, 7, 3)] {
        let data = bytes(len, salt);
        let total = at + len.div_ceil(2) + 5;
        let poison = nemotron_rs::POISON_BF16;
        let mut dst = gpu.upload(&vec![poison; total]).unwrap();
        gpu.upload_bytes_into(&data, &mut dst.slice_mut(at..)).unwrap();
        let got = gpu.download(&dst).unwrap();
        let got_bytes: Vec<u8> = got.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
        if len > 0 {
            n += nemotron_rs::assert_same(&format!("{len} bytes at {at}"), &got_bytes[2 * at..2 * at + len], &data);
        }
        let untouched = |v: &[half::bf16]| v.iter().all(|x| x.to_bits() == poison.to_bits());
        assert!(untouched(&got[..at]) && untouched(&got[at + len.div_ceil(2)..]), "{len} bytes at {at}: beyond");
    }
    let mut small = gpu.zeros::<half::bf16>(4).unwrap();
    let err = gpu.upload_bytes_into(&[0u8; 9], &mut small.slice_mut(..)).unwrap_err();
    assert!(err.to_string().contains("dst"), "{err}");
    let err = gpu.capture(|| gpu.upload_bytes_into(&[0u8; 8], &mut small.slice_mut(..))).map(|_| ()).unwrap_err();
    assert!(matches!(err, Error::InCapture(_)), "{err}");
    assert_eq!(n, 5 * stage / 2 + 6 + 1000);
    println!("upload_bytes_into: {n} bytes compared");
}
