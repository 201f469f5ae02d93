//! How a MoE layer runs a step on the CUDA backend, decided apart from running it: a
//! [`MoePlan`] from the step's rows and the layer's [`MoeKind`] (the experts' format, the
//! shared expert's form, the sizes, whether the GPU has `wgmma`), with the row counts where the
//! paths switch in the table below, each measured where it is defined. The executor
//! (`CudaExperts::execute`) runs the plan's parts: route, dispatch, experts, combine.

use host::grouped::NVFP4_GROUPED_K_MULTIPLE;
use host::moe::{MAX_EXPERTS, MAX_TOP_K};

/// Most rows of a bf16 MoE layer that go through the expert kernel rather than a GEMM: the
/// routed experts alone (`cargo bench --bench moe -- experts/b`, H200, Nano sizes) took 370.0
/// us by the expert kernel at 16 rows against 419.4 by the grouped GEMM on `wgmma` and 467.5
/// on the 128-row `mma.sync` tiles, 969.7 at 64 rows against 706.3 and 809.7; the lines cross
/// near 23 rows (`wgmma`) and 34 (`mma.sync`).
pub const EXPERT_KERNEL_MAX_ROWS: usize = 32;

/// Most rows of an FP8 MoE layer that go through the expert kernel rather than the FP8
/// grouped GEMM (where its sizes allow it: multiples of 16): none past the one row that runs
/// per routing choice. The routed experts alone (`cargo bench --bench moe -- experts/b`, H200,
/// Nano sizes) took 216.5 us by the expert kernel on tensor cores at 8 rows against 187.0 by
/// the FP8 grouped GEMM on `wgmma`, 657.3 against 461.2 at 64; FP8 `Engine::step` (one lease,
/// 2026-12-04) went from 7.264 to 6.467 ms at decode batch 8 and from 22.524 to 17.958 at 64
/// when this went from 64 to 1.
pub const FP8_EXPERT_KERNEL_MAX_ROWS: usize = 1;

/// Most rows of an NVFP4 MoE layer that go through the expert kernels (weight-only, from the
/// codes: the warp mode, or the tensor cores where the experts average two rows or more,
/// `host::gemv::NVFP4_TC_MIN_ROWS`); more take the NVFP4 grouped GEMM (`host::grouped::grouped_nvfp4`,
/// the codes made bf16 in shared memory) where the sizes are multiples of
/// `host::grouped::NVFP4_GROUPED_K_MULTIPLE`: on `wgmma` past [`NVFP4_NARROW_MAX_ROWS`] where
/// the GPU has it, else on the 64-row `mma.sync` tiles up to [`GROUPED_MAX_ROWS`] (past them,
/// and for other sizes, every expert dequantized to bf16 for bf16's path). The routed experts
/// alone (`cargo bench --bench moe -- experts/b`, an H100, Nano sizes): the expert kernel 685.1
/// us at 64 rows against 821.2 by the NVFP4 grouped GEMM on `wgmma`, 1229.2 against 742.5 on
/// the 64-row tiles at 256.
pub const NVFP4_EXPERT_KERNEL_MAX_ROWS: usize = 64;

/// Most rows of an NVFP4 MoE layer whose experts take the NVFP4 grouped GEMM on the 64-row
/// `mma.sync` tiles where the GPU also has the `wgmma` one: the experts' weights read a few
/// times each, the smaller tiles waste fewer products. The routed experts alone (`cargo bench
/// --bench moe -- experts/b`, an H100, Nano sizes, one lease): the 64-row tiles 742.5 us at 256
/// rows against 840.2 on `wgmma`, 752.3 against 848.0 at 512, 825.9 against 839.0 at 1024,
/// 2558.6 against 1691.4 at 4096.
pub const NVFP4_NARROW_MAX_ROWS: usize = 1024;

/// Most rows of a bf16 MoE layer whose experts run as the grouped GEMM on `mma.sync` where the
/// GPU has no `wgmma` kernels; more go through per-expert cuBLASLt GEMMs. Where it has them
/// (sm_90a) the grouped GEMM on `wgmma` takes every row count past the expert kernel's. The
/// routed experts on the H200 (`cargo bench --bench moe -- experts/b`, Nano sizes): the
/// 128-row `mma.sync` tiles took 2098.5 us at 4096 rows against cuBLASLt's 3338.8, 6725.4 at
/// 16384 against 4886.0 (the lines cross between); `wgmma` 1532.4 and 4673.3.
pub const GROUPED_MAX_ROWS: usize = 8192;

/// Most rows of a MoE layer (bf16 or FP8) whose experts run per routing choice, without a
/// dispatch, the down projections and the combining in one launch (`host::moe::experts_mlp_choices`).
pub const CHOICES_MAX_ROWS: usize = 1;

/// Most rows of a MoE layer whose shared expert runs as pieces inside the routed experts'
/// launches (see `Shared::Pieces` in the executor) rather than as two cuBLASLt GEMMs: the expert kernel
/// streams the weights once per row, so only a single row gains.
pub const SHARED_PIECES_MAX_ROWS: usize = 1;

/// How many pieces of the routed experts' shape (`inter` wide) a shared expert `shared` wide is
/// cut into beside `routed` experts (bf16 layers, FP8 ones whose inputs all have static scales,
/// NVFP4 ones); 0 (its own MLP) where a dispatch could not count them among the experts.
pub(super) fn shared_pieces(routed: usize, inter: usize, shared: usize) -> usize {
    let pieces = shared.div_ceil(inter);
    if routed + pieces <= MAX_EXPERTS as usize { pieces } else { 0 }
}

/// The pieces the routing appends to each token's top-k in a step of `rows` rows: all of them
/// at one row (they then run in the routed experts' launches; the expert kernel streams weights
/// once per row, so more rows take cuBLASLt) when the choices fit the routing, else none.
fn appended_pieces(rows: usize, top_k: usize, pieces: usize) -> usize {
    if rows <= SHARED_PIECES_MAX_ROWS && top_k + pieces <= MAX_TOP_K as usize { pieces } else { 0 }
}

/// The experts' format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Bf16,
    Fp8,
    Nvfp4,
    /// Up and down projections of different formats: past one row only the expert kernel
    /// takes them (each projection as it is).
    Mixed,
}

/// How a layer holds its shared expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedForm {
    None,
    /// Its own MLP (FP8 and NVFP4 layers without pieces).
    Mlp,
    /// This many pieces of the routed experts' shape stored after them (bf16 layers).
    Pieces(usize),
    /// Its own MLP, and this many pieces stored after the routed experts for steps of one row
    /// (FP8 layers with static input scales, NVFP4 layers: their GEMMs take no pieces).
    MlpAndPieces(usize),
}

/// What a MoE layer is, as far as its plan goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeKind {
    pub format: Format,
    pub shared: SharedForm,
    pub top_k: usize,
    /// The routed experts' intermediate and hidden sizes.
    pub inter: usize,
    pub hidden: usize,
    /// Whether the GPU has the grouped GEMM on `wgmma` (sm_90a).
    pub wgmma: bool,
}

/// How a step's shared expert runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SharedPath {
    None,
    /// Its own MLP, beside the routed experts.
    Mlp,
    /// Its pieces as two cuBLASLt GEMMs (the up and down matrices they make together).
    PiecesGemm,
    /// This many pieces appended to each token's choices with weight 1 by the routing: they run
    /// in the routed experts' launches (per choice, their up projections in the routing's
    /// launch itself), and the combine sums them.
    Appended(usize),
}

/// How a step's routed experts run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPath {
    /// Per routing choice, no dispatch; the down projections and the combining in one launch.
    Choices,
    /// Dispatched; each active expert's projections by the expert kernel of its format.
    ExpertKernel,
    /// Dispatched; the grouped GEMM on tensor cores, on the GPU's fastest tiles
    /// (`host::grouped::experts_mlp_grouped`: bf16, FP8, or NVFP4 from its codes; NVFP4
    /// dequantized to bf16 into a temporary first where `dequantize`).
    Grouped { dequantize: bool },
    /// Dispatched; the NVFP4 grouped GEMM from the codes on the 64-row `mma.sync` tiles where
    /// the GPU also has `wgmma` ([`NVFP4_NARROW_MAX_ROWS`]).
    GroupedNarrow,
    /// Dispatched; a cuBLASLt GEMM pair per expert (bf16, or NVFP4 dequantized first).
    PerExpertGemm { dequantize: bool },
}

/// How one MoE layer runs one step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoePlan {
    pub shared: SharedPath,
    pub experts: ExpertPath,
}

impl MoePlan {
    /// The plan of a step of `rows` rows through a layer of kind `k`.
    pub fn new(k: &MoeKind, rows: usize) -> MoePlan {
        let (pieces, stored) = match k.shared {
            SharedForm::Pieces(n) => (n, n),
            SharedForm::MlpAndPieces(n) => (0, n),
            _ => (0, 0),
        };
        let appended = appended_pieces(rows, k.top_k, stored);
        let shared = match k.shared {
            SharedForm::None => SharedPath::None,
            SharedForm::Pieces(_) | SharedForm::MlpAndPieces(_) if appended > 0 => SharedPath::Appended(appended),
            SharedForm::Mlp | SharedForm::MlpAndPieces(_) => SharedPath::Mlp,
            SharedForm::Pieces(_) => SharedPath::PiecesGemm,
        };
        let sized = |m: usize| k.inter.is_multiple_of(m) && k.hidden.is_multiple_of(m);
        // Whether a grouped GEMM whose sizes must be multiples of `m` takes the rows: on `wgmma`
        // at any row count, on `mma.sync` up to GROUPED_MAX_ROWS.
        let grouped = |m: usize| (rows <= GROUPED_MAX_ROWS || k.wgmma) && sized(m);
        // bf16's GEMMs: the grouped GEMM where it takes the rows, else per expert.
        let bf16 = |dequantize| match grouped(8) {
            true => ExpertPath::Grouped { dequantize },
            false => ExpertPath::PerExpertGemm { dequantize },
        };
        let experts = match k.format {
            _ if rows <= CHOICES_MAX_ROWS => ExpertPath::Choices,
            Format::Bf16 if rows > EXPERT_KERNEL_MAX_ROWS => bf16(false),
            Format::Nvfp4 if rows > NVFP4_EXPERT_KERNEL_MAX_ROWS => match grouped(NVFP4_GROUPED_K_MULTIPLE) {
                true if k.wgmma && rows <= NVFP4_NARROW_MAX_ROWS => ExpertPath::GroupedNarrow,
                true => ExpertPath::Grouped { dequantize: false },
                false => bf16(true),
            },
            Format::Fp8 if rows > FP8_EXPERT_KERNEL_MAX_ROWS && pieces == 0 && sized(16) => {
                ExpertPath::Grouped { dequantize: false }
            }
            _ => ExpertPath::ExpertKernel,
        };
        MoePlan { shared, experts }
    }

    /// The shared expert's pieces the routing appends to each token's choices.
    pub fn appended(&self) -> usize {
        match self.shared {
            SharedPath::Appended(n) => n,
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ExpertPath::{Choices, ExpertKernel, Grouped, GroupedNarrow, PerExpertGemm};
    use super::*;

    #[test]
    fn shared_expert_pieces_only_where_the_kernels_take_them() {
        // Nano: 128 experts of 1856, a shared expert of 3712; one wider; at the dispatch's
        // limit of 256 experts and past it.
        assert_eq!(shared_pieces(128, 1856, 3712), 2);
        assert_eq!(shared_pieces(128, 1856, 3713), 3);
        assert_eq!(shared_pieces(254, 32, 64), 2);
        assert_eq!(shared_pieces(255, 32, 64), 0);
        // Appended at one row only, and only when top-k and pieces fit the routing's 16.
        assert_eq!(appended_pieces(1, 6, 2), 2);
        assert_eq!(appended_pieces(2, 6, 2), 0);
        assert_eq!(appended_pieces(1, 14, 2), 2);
        assert_eq!(appended_pieces(1, 15, 3), 0);
        assert_eq!(appended_pieces(1, 6, 0), 0);
    }

    /// Nano's MoE layer (top 6 of 128 experts of 1856, hidden 2688) in each format.
    fn nano(format: Format, wgmma: bool) -> MoeKind {
        let shared = if format == Format::Bf16 { SharedForm::Pieces(2) } else { SharedForm::Mlp };
        MoeKind { format, shared, top_k: 6, inter: 1856, hidden: 2688, wgmma }
    }

    fn paths(k: &MoeKind, rows: &[usize]) -> Vec<(SharedPath, ExpertPath)> {
        rows.iter().map(|&r| MoePlan::new(k, r)).map(|p| (p.shared, p.experts)).collect()
    }

    /// Every row count where a path switches, on each side, in each format, with and without
    /// `wgmma`.
    #[test]
    fn each_row_count_takes_its_path() {
        use SharedPath::{Appended, Mlp, PiecesGemm};
        let rows = [1, 2, 32, 33, 64, 65, 8192, 8193];
        let grouped = Grouped { dequantize: false };
        let bf16 = |wgmma| paths(&nano(Format::Bf16, wgmma), &rows);
        let mut want = vec![(Appended(2), Choices), (PiecesGemm, ExpertKernel), (PiecesGemm, ExpertKernel)];
        want.extend([(PiecesGemm, grouped); 4]);
        assert_eq!(bf16(true), [&want[..], &[(PiecesGemm, grouped)]].concat());
        assert_eq!(bf16(false), [&want[..], &[(PiecesGemm, PerExpertGemm { dequantize: false })]].concat());
        let fp8 = paths(&nano(Format::Fp8, false), &rows);
        assert_eq!(fp8, [&[(Mlp, Choices)][..], &[(Mlp, grouped); 7]].concat());
        // FP8 with static input scales: the pieces appended at one row, its MLP past it.
        let both = MoeKind { shared: SharedForm::MlpAndPieces(2), ..nano(Format::Fp8, true) };
        assert_eq!(paths(&both, &rows), [&[(Appended(2), Choices)][..], &[(Mlp, grouped); 7]].concat());
        let nvfp4_rows = [1, 2, 32, 33, 64, 65, 1024, 1025, 8192, 8193];
        let nvfp4 = paths(&nano(Format::Nvfp4, true), &nvfp4_rows);
        let mut want = vec![(Mlp, Choices)];
        want.extend([(Mlp, ExpertKernel); 4]);
        want.extend([(Mlp, GroupedNarrow); 2]);
        want.extend([(Mlp, grouped); 3]);
        assert_eq!(nvfp4, want);
        let nvfp4 = paths(&nano(Format::Nvfp4, false), &[65, 1025, 8192, 8193]);
        assert_eq!(nvfp4, [(Mlp, grouped), (Mlp, grouped), (Mlp, grouped), (Mlp, PerExpertGemm { dequantize: true })]);
        // Sizes the NVFP4 grouped GEMM does not take (k a multiple of 64) are dequantized.
        let odd = MoeKind { inter: 1856 + 16, ..nano(Format::Nvfp4, true) };
        assert_eq!(MoePlan::new(&odd, 65).experts, Grouped { dequantize: true });
    }

    /// Up and down projections of different formats run per choice at one row, else by the
    /// expert kernel (the GEMM paths take one format).
    #[test]
    fn mixed_formats_take_the_expert_kernel() {
        let mixed = MoeKind { shared: SharedForm::Mlp, ..nano(Format::Mixed, true) };
        let want = [(SharedPath::Mlp, Choices), (SharedPath::Mlp, ExpertKernel), (SharedPath::Mlp, ExpertKernel)];
        assert_eq!(paths(&mixed, &[1, 65, 8193]), want);
    }

    /// Sizes the GEMMs' tiles do not take keep the expert kernel (FP8: multiples of 16) or go
    /// per expert (bf16: multiples of 8); without a shared expert there is none to run; a top-k
    /// that leaves no room for the pieces in the routing runs them through cuBLASLt.
    #[test]
    fn odd_sizes_and_full_routings_take_the_general_paths() {
        let fp8 = MoeKind { inter: 1864, ..nano(Format::Fp8, true) };
        assert_eq!(MoePlan::new(&fp8, 64).experts, ExpertKernel);
        let bf16 = MoeKind { hidden: 2692, ..nano(Format::Bf16, true) };
        assert_eq!(MoePlan::new(&bf16, 64).experts, PerExpertGemm { dequantize: false });
        let bare = MoeKind { shared: SharedForm::None, ..nano(Format::Bf16, true) };
        assert_eq!(MoePlan::new(&bare, 1), MoePlan { shared: SharedPath::None, experts: Choices });
        let full = MoeKind { top_k: 15, shared: SharedForm::Pieces(2), ..nano(Format::Bf16, true) };
        assert_eq!(MoePlan::new(&full, 1).shared, SharedPath::PiecesGemm);
        assert_eq!(MoePlan::new(&full, 1).appended(), 0);
        let full = MoeKind { top_k: 15, shared: SharedForm::MlpAndPieces(2), ..nano(Format::Fp8, true) };
        assert_eq!(MoePlan::new(&full, 1).shared, SharedPath::Mlp);
    }
}
