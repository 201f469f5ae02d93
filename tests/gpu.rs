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
