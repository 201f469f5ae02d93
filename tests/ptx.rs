//! The embedded PTX of every arch: right `.target`, its kernel entries present, and accepted
//! by ptxas 13.x for that arch. Needs ptxas: `cargo xtask test` provisions it and sets PTXAS.

use host::{Arch, Kernel};

#[test]
fn every_arch_declares_its_target() {
    for arch in Arch::ALL {
        let target = arch.ptx().lines().find_map(|l| l.strip_prefix(".target ")).map(str::trim);
        assert_eq!(target, Some(arch.name()), "{}: .target line", arch.name());
        let version = arch.ptx().lines().find_map(|l| l.strip_prefix(".version ")).map(str::trim);
        assert_eq!(version, Some(arch.ptx_isa()), "{}: .version line", arch.name());
    }
}

/// Each arch's PTX holds exactly the kernels `Kernel::in_arch` gives it: the `wgmma` ones on
/// sm_90a alone, the block-scaled FP4 ones on sm_121a alone, the `tcgen05` one on sm_110a
/// alone, the others everywhere.
#[test]
fn every_kernel_is_an_entry_of_its_arches() {
    let mut checked = 0;
    for arch in Arch::ALL {
        let mine: Vec<Kernel> = Kernel::ALL.iter().copied().filter(|k| k.in_arch(arch.name())).collect();
        for k in Kernel::ALL {
            let decl = format!(".visible .entry {}(", k.name());
            let has = arch.ptx().contains(&decl);
            assert_eq!(has, k.in_arch(arch.name()), "{}: `.entry {}` present: {has}", arch.name(), k.name());
            checked += 1;
        }
        let entries = arch.ptx().matches(".visible .entry ").count();
        assert_eq!(entries, mine.len(), "{}: entries not listed in Kernel", arch.name());
    }
    assert_eq!(checked, Arch::ALL.len() * Kernel::ALL.len());
    for k in Kernel::ALL {
        let only = if k.needs_wgmma() {
            Some("sm_90a")
        } else if k.needs_block_scaled_fp4() {
            Some("sm_121a")
        } else if k.needs_tcgen05() {
            Some("sm_110a")
        } else {
            None
        };
        for arch in Arch::ALL {
            let want = only.is_none_or(|a| a == arch.name());
            assert_eq!(k.in_arch(arch.name()), want, "{} on {}", k.name(), arch.name());
        }
    }
    let special = |f: fn(Kernel) -> bool| Kernel::ALL.iter().filter(|&&k| f(k)).count();
    assert!(
        [Kernel::needs_wgmma, Kernel::needs_block_scaled_fp4, Kernel::needs_tcgen05]
            .into_iter()
            .all(|f| special(f) > 0)
    );
}

#[test]
fn the_fused_mamba_decode_is_bounded_at_its_block() {
    // host/ptx_build.rs adds the bound (rustc has no attribute for it); the launch uses
    // MAMBA_BLOCK threads, which more than 128 registers a thread would not fit.
    let want = format!(".maxntid {}, 1, 1", kernels_gpu::mamba::MAMBA_BLOCK);
    for arch in Arch::ALL {
        let ptx = arch.ptx();
        let at = ptx.find(".entry mamba_decode_bf16(").expect("entry present");
        let body = at + ptx[at..].find("\n{").expect("entry has a body");
        assert!(ptx[at..body].contains(&want), "{}: mamba_decode_bf16 lacks `{want}`", arch.name());
    }
}

#[test]
fn no_unresolved_functions_in_the_ptx() {
    for arch in Arch::ALL {
        assert!(!arch.ptx().contains(".extern .func"), "{}: PTX calls an external function", arch.name());
    }
}

#[test]
fn ptxas_assembles_every_arch() {
    let ptxas = std::env::var("PTXAS").unwrap_or_else(|_| "ptxas".into());
    let dir = std::env::temp_dir().join(format!("nemotron-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in Arch::ALL {
        let src = dir.join(format!("{}.ptx", arch.name()));
        std::fs::write(&src, arch.ptx()).unwrap();
        let out = std::process::Command::new(&ptxas)
            .args(["-arch", arch.name(), "-o"])
            .arg(dir.join(format!("{}.cubin", arch.name())))
            .arg(&src)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run `{ptxas}` ({e}): run the tests with `cargo xtask test`, which provisions ptxas 13.x")
            });
        assert!(out.status.success(), "ptxas -arch {} failed:\n{}", arch.name(), String::from_utf8_lossy(&out.stderr));
        println!("ptxas -arch {}: ok", arch.name());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn arch_selection_by_compute_capability() {
    assert_eq!(Arch::for_compute_capability(9, 0).unwrap(), Arch::Sm90a);
    assert_eq!(Arch::for_compute_capability(11, 0).unwrap(), Arch::Sm110a);
    assert_eq!(Arch::for_compute_capability(12, 1).unwrap(), Arch::Sm121a);
    // Newer or other >= 9.0 devices get the forward-compatible sm_90 PTX.
    assert_eq!(Arch::for_compute_capability(9, 1).unwrap(), Arch::Sm90);
    assert_eq!(Arch::for_compute_capability(10, 0).unwrap(), Arch::Sm90);
    assert_eq!(Arch::for_compute_capability(12, 0).unwrap(), Arch::Sm90);
    // NEMO_ARCH's choices: the plain sm_90 PTX on any of them, each arch-specific one on its
    // own device only, and names of no arch refused.
    assert_eq!(Arch::named("sm_90", 9, 0).unwrap(), Arch::Sm90);
    assert_eq!(Arch::named("sm_90", 12, 1).unwrap(), Arch::Sm90);
    assert_eq!(Arch::named("sm_90a", 9, 0).unwrap(), Arch::Sm90a);
    for (name, major, minor) in
        [("sm_90a", 10, 0), ("sm_90a", 9, 1), ("sm_110a", 9, 0), ("sm_121a", 12, 0), ("sm_80", 9, 0)]
    {
        let err = Arch::named(name, major, minor).unwrap_err();
        assert!(matches!(err, host::Error::ArchRefused { .. }), "{name} on {major}.{minor}: {err}");
    }
    for arch in Arch::ALL {
        assert_eq!(arch.runs_on(9, 0), matches!(arch, Arch::Sm90 | Arch::Sm90a), "{arch:?} on 9.0");
    }
    for (major, minor) in [(8, 9), (8, 0), (7, 5)] {
        let err = Arch::for_compute_capability(major, minor).unwrap_err();
        assert!(matches!(err, host::Error::UnsupportedArch { .. }), "{major}.{minor}: {err}");
        assert!(err.to_string().contains(&format!("{major}.{minor}")), "{err}");
    }
}

/// The kernels whose fixed shared memory is more than a block of the sm_12x family may have
/// (101376 bytes, 99 KiB: DGX Spark's sm_121a; sm_90, sm_100 and sm_110a blocks have 232448)
/// are those the host runs only where `Gpu::fits` says they fit, with another path
/// elsewhere: the 128-row grouped GEMM tiles (`Tiles::for_grouped` takes the 64-row ones;
/// `gemm_m128_bf16` runs only where a caller asks for those tiles) and the flash attention
/// kernels of 64 keys a tile (`host::attn::attention` takes those of 32, 87040 bytes). A kernel
/// that grows past the limit must join them, with its fallback.
#[test]
fn kernels_too_big_for_sm12x_blocks_have_fallbacks() {
    const SM12X_BLOCK_SMEM: u32 = 101376;
    let mut big: Vec<Kernel> = Kernel::ALL
        .iter()
        .copied()
        .filter(|k| k.in_arch("sm_121a") && matches!(k.smem(), host::Smem::Fixed(b) if b > SM12X_BLOCK_SMEM))
        .collect();
    big.sort_by_key(|k| k.name());
    let want = [Kernel::AttnFlash, Kernel::AttnFlashD128, Kernel::GemmWideBf16, Kernel::MoeGroupedWide];
    assert_eq!(big, want);
}

/// The `wgmma` kernels' asm blocks stand once each in their entries (the compiler may not copy
/// or split them: each holds a fence, products, their commit and the wait for them, and the
/// whole warpgroup must run it together): bf16 one block of 8 products a stage and one of 4 for
/// the tiles of at most 64 rows (a warpgroup's half of the columns), FP8 the same (the 8 as two
/// halves of 4, two commits and two waits), NVFP4 (its codes made bf16) the block of 8 only,
/// the flash kernel two of 8 a key tile (scores, then `P V`).
#[test]
fn wgmma_stages_stand_once_in_their_entries() {
    let ptx = Arch::Sm90a.ptx();
    let mut checked = 0;
    for k in Kernel::ALL.iter().filter(|k| k.needs_wgmma()) {
        let at = ptx.find(&format!(".entry {}(", k.name())).expect("entry present");
        let end = ptx[at + 1..].find(".entry ").map_or(ptx.len(), |e| at + 1 + e);
        let body = &ptx[at..end];
        let (products, fences) = match k.name() {
            n if n.starts_with("attn_flash") => (16, 2),
            n if n.contains("nvfp4") => (8, 1),
            _ => (8 + 4, 2),
        };
        let count = |s: &str| body.matches(s).count();
        assert_eq!(count("wgmma.mma_async"), products, "{}: products", k.name());
        assert_eq!(count("wgmma.fence"), fences, "{}: fences", k.name());
        assert_eq!(count("wgmma.commit_group"), count("wgmma.wait_group"), "{}: commits and waits", k.name());
        checked += 1;
    }
    assert_eq!(checked, 6);
}
