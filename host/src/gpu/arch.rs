//! `Arch`: the PTX flavours embedded in this crate, and which one a device of a given compute
//! capability gets.

use crate::error::{Error, Result};

/// A PTX flavour embedded in this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper and later without their own PTX: compute capability 9.0 and up, JIT-compiled
    /// by the driver; PTX ISA 8.4 (for the FP8 `mma`).
    Sm90,
    /// Hopper (H100, H200): compute capability 9.0 with its arch-specific instructions
    /// (`wgmma`); PTX ISA 8.4.
    Sm90a,
    /// Jetson Thor: compute capability 11.0; PTX ISA 9.0.
    Sm110a,
    /// DGX Spark GB10: compute capability 12.1, arch-specific features; PTX ISA 8.8.
    Sm121a,
}

impl Arch {
    /// Every embedded arch.
    pub const ALL: [Arch; 4] = [Arch::Sm90, Arch::Sm90a, Arch::Sm110a, Arch::Sm121a];

    /// The `-C target-cpu` / `.target` name.
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Sm90 => "sm_90",
            Arch::Sm90a => "sm_90a",
            Arch::Sm110a => "sm_110a",
            Arch::Sm121a => "sm_121a",
        }
    }

    /// The PTX ISA version rustc emits for this arch.
    pub const fn ptx_isa(self) -> &'static str {
        match self {
            Arch::Sm90 | Arch::Sm90a => "8.4",
            Arch::Sm110a => "9.0",
            Arch::Sm121a => "8.8",
        }
    }

    /// The embedded PTX text.
    pub const fn ptx(self) -> &'static str {
        match self {
            Arch::Sm90 => include_str!(concat!(env!("OUT_DIR"), "/sm_90.ptx")),
            Arch::Sm90a => include_str!(concat!(env!("OUT_DIR"), "/sm_90a.ptx")),
            Arch::Sm110a => include_str!(concat!(env!("OUT_DIR"), "/sm_110a.ptx")),
            Arch::Sm121a => include_str!(concat!(env!("OUT_DIR"), "/sm_121a.ptx")),
        }
    }

    /// The PTX a device of compute capability `major.minor` loads: `NEMO_ARCH` where set (an
    /// arch name, e.g. `sm_90` on an H200 to compare the plain PTX with sm_90a's; refused
    /// where that PTX cannot run on the device, [`Arch::runs_on`]), else
    /// [`Arch::for_compute_capability`].
    pub fn for_device(major: i32, minor: i32) -> Result<Arch> {
        match std::env::var("NEMO_ARCH") {
            Ok(name) => Arch::named(&name, major, minor),
            Err(_) => Arch::for_compute_capability(major, minor),
        }
    }

    /// The arch called `name`, where its PTX runs on a device of `major.minor`.
    pub fn named(name: &str, major: i32, minor: i32) -> Result<Arch> {
        let arch = Arch::ALL.into_iter().find(|a| a.name() == name);
        match arch {
            Some(a) if a.runs_on(major, minor) => Ok(a),
            _ => Err(Error::ArchRefused { name: name.to_string(), major, minor }),
        }
    }

    /// Whether this PTX runs on a device of compute capability `major.minor`: sm_90's on 9.0
    /// and newer (the driver JIT-compiles it), the arch-specific ones on their own device only.
    pub fn runs_on(self, major: i32, minor: i32) -> bool {
        match self {
            Arch::Sm90 => major >= 9,
            Arch::Sm90a => (major, minor) == (9, 0),
            Arch::Sm110a => (major, minor) == (11, 0),
            Arch::Sm121a => (major, minor) == (12, 1),
        }
    }

    /// Picks the PTX for a device of compute capability `major.minor`.
    ///
    /// 9.0 (sm_90a: arch-specific PTX runs only there), 11.0 and 12.1 get their own PTX. Any
    /// other device of 9.0 or newer gets the sm_90 PTX, which the driver JIT-compiles for it
    /// (plain `sm_90` PTX is forward compatible); that pairing is not verified by this
    /// project. Older devices are refused: the kernels use sm_89+ FP8 conversions.
    pub fn for_compute_capability(major: i32, minor: i32) -> Result<Arch> {
        match (major, minor) {
            (9, 0) => Ok(Arch::Sm90a),
            (11, 0) => Ok(Arch::Sm110a),
            (12, 1) => Ok(Arch::Sm121a),
            (m, _) if m >= 9 => Ok(Arch::Sm90),
            _ => Err(Error::UnsupportedArch { major, minor }),
        }
    }
}
