//! One step's operations in the model's order ([`forward`]: embedding, each layer's parts, the
//! residuals and norms between them, the LM head), and what a step notes about itself between
//! them ([`Marks`]: a profile's stamps, the expert loads of a tallied step).

use super::{MixW, StepCounters, Weights};
use crate::backend::{AttentionOps, Backend, In, MambaOps, MoeWeights, Norm, Out};
use crate::config::{Config, MoeConfig};
use crate::error::Result;
use crate::profile::{ExpertLoad, Part as P, Profile, Span, Stage};

/// What a step notes about itself: the stamps of a profiled step (`None` unless profiling:
/// then marking does nothing) and the expert loads of a tallied one (`None` unless
/// tallying).
pub(super) struct Marks<B: Backend> {
    stamps: Option<Stamps<B>>,
    pub(super) loads: Option<Vec<ExpertLoad>>,
}

/// The first stamp of a step, then one after each stage with the stage it ends.
struct Stamps<B: Backend> {
    first: B::Stamp,
    ends: Vec<(Stage, B::Stamp)>,
}

impl<B: Backend> Marks<B> {
    pub(super) fn new(b: &B, profiling: bool, tallying: bool) -> Result<Marks<B>> {
        let stamps = if profiling { Some(Stamps { first: b.stamp()?, ends: Vec::new() }) } else { None };
        Ok(Marks { stamps, loads: tallying.then(Vec::new) })
    }

    /// The work queued since the last stamp was `stage`.
    pub(super) fn end(&mut self, b: &B, stage: Stage) -> Result<()> {
        if let Some(s) = &mut self.stamps {
            s.ends.push((stage, b.stamp()?));
        }
        Ok(())
    }

    /// When tallying, the load of MoE layer `layer` (`w`, of `c`) over `rows` rows of `x`.
    fn tally(
        &mut self,
        b: &B,
        layer: usize,
        (c, w): (&MoeConfig, &MoeWeights<B>),
        x: In<B::Buf>,
        rows: usize,
    ) -> Result<()> {
        if let Some(loads) = &mut self.loads {
            loads.push(ExpertLoad::of(layer, c.experts, &w.choices(b, c, x, rows)?)?);
        }
        Ok(())
    }

    /// Each stage's time, from the stamp before it to its own (waits for the last).
    pub(super) fn profile(&mut self, b: &B) -> Result<Option<Profile>> {
        let Some(Stamps { first, ends }) = self.stamps.take() else { return Ok(None) };
        let mut spans = Vec::with_capacity(ends.len());
        let mut from = &first;
        for (stage, to) in &ends {
            spans.push(Span { stage: *stage, ms: b.ms_between(from, to)? });
            from = to;
        }
        Ok(Some(Profile { spans }))
    }
}

/// One step's rows as [`forward`] runs them: `nd` decode rows, then prefill sequences of
/// `seqs` tokens each, readied in `rows`.
pub(super) struct Step<'a, B: Backend> {
    pub(super) nd: usize,
    pub(super) seqs: &'a [usize],
    pub(super) rows: &'a B::Rows,
}

/// Queues one step's operations; the logits of the rows `step.rows.last` names go to `logits`
/// (without prefill, every row's, in order). Marks each stage's end in `marks` (nothing when
/// they are off).
pub(super) fn forward<B: Backend>(
    b: &B,
    config: &Config,
    w: &mut Weights<B>,
    Step { nd, seqs, rows }: Step<B>,
    logits: &mut B::Buf,
    marks: &mut Marks<B>,
) -> Result<StepCounters> {
    let hidden = config.hidden_size;
    let eps = config.norm_eps;
    // The norms of hidden rows: each layer's, and the final one.
    let norm = |w| Norm { w, width: hidden, eps };
    let n = nd + seqs.iter().sum::<usize>();
    let prefill = !seqs.is_empty();
    let mut counters = StepCounters::default();
    let mut h = b.scratch(n * hidden)?;
    b.embed(&w.embeddings, hidden, rows, Out { buf: &mut h, offset: 0 })?;
    let mut x = b.scratch(n * hidden)?;
    let mut out = b.scratch(n * hidden)?;
    if let Some(first) = w.norms.first() {
        b.rms_norm(In::rows(&h, hidden), norm(first), n, Out { buf: &mut x, offset: 0 })?;
    }
    marks.end(b, Stage::Embed)?;
    for (i, (mix, kind)) in w.layers.iter_mut().zip(&config.layers).enumerate() {
        if let (MixW::Moe(mw), Some(c)) = (&*mix, &config.moe) {
            marks.tally(b, i, (c, mw), In::rows(&x, hidden), n)?;
        }
        let mut done = |part| marks.end(b, Stage::Layer { index: i, kind: *kind, part });
        match mix {
            MixW::Mamba(m) => {
                let c = config.mamba.as_ref().expect("mamba layers come with mamba settings");
                let (inner, cd, wd) = (c.inner(), c.conv_dim(), c.in_proj_width());
                let mut zx = b.scratch(n * wd)?;
                m.in_proj(b, In::rows(&x, hidden), n, Out { buf: &mut zx, offset: 0 })?;
                done(P::InProj)?;
                let zxr = In::rows(&zx, wd);
                // The gated norm's output: the decode rows', then the prefill rows'.
                let mut yn = b.scratch(n * inner)?;
                if nd > 0 {
                    m.decode(b, zxr, nd, rows, Out { buf: &mut yn, offset: 0 })?;
                    done(P::Decode)?;
                    counters.conv_updates += 1;
                    counters.state_updates += 1;
                }
                if prefill {
                    let np = n - nd;
                    let mut xbc = b.scratch(np * cd)?;
                    m.conv(b, zxr.at(nd, inner), rows, Out { buf: &mut xbc, offset: 0 })?;
                    done(P::Conv)?;
                    let mut y = b.scratch(np * inner)?;
                    let (xbcr, dt) = (In::rows(&xbc, cd), zxr.at(nd, inner + cd));
                    m.scan(b, xbcr, dt, rows, Out { buf: &mut y, offset: 0 })?;
                    done(P::Scan)?;
                    let yo = Out { buf: &mut yn, offset: nd * inner };
                    m.gated_norm(b, In::rows(&y, inner), zxr.at(nd, 0), np, yo)?;
                    done(P::GatedNorm)?;
                    counters.conv_forwards += 1;
                    counters.chunk_scans += 1;
                }
                m.out_proj(b, In::rows(&yn, inner), n, Out { buf: &mut out, offset: 0 })?;
                done(P::OutProj)?;
            }
            MixW::Moe(mw) => {
                let c = config.moe.as_ref().expect("moe layers come with moe settings");
                mw.forward(b, c, In::rows(&x, hidden), n, Out { buf: &mut out, offset: 0 })?;
                done(P::Moe)?;
                counters.moe_calls += 1;
            }
            MixW::Attention(a) => {
                let c = config.attention.as_ref().expect("attention layers come with attention settings");
                let qw = c.heads * c.head_dim;
                let qkv = a.qkv(b, In::rows(&x, hidden), n)?;
                done(P::Qkv)?;
                let mut att = b.scratch(n * qw)?;
                a.attend(b, &qkv, rows, Out { buf: &mut att, offset: 0 })?;
                done(P::Attend)?;
                a.out(b, In::rows(&att, qw), n, Out { buf: &mut out, offset: 0 })?;
                done(P::OProj)?;
                counters.attention_calls += 1;
            }
            MixW::Mlp { up, down } => {
                b.mlp(In::rows(&x, hidden), n, up, down, Out { buf: &mut out, offset: 0 })?;
                done(P::Mlp)?;
            }
        }
        // The residual, and the next layer's norm (the final norm after the last layer).
        let next = w.norms.get(i + 1).unwrap_or(&w.norm_f);
        b.add_rms_norm(&mut h, &out, norm(next), n, Out { buf: &mut x, offset: 0 })?;
        done(P::Residual)?;
    }
    if w.layers.is_empty() {
        b.rms_norm(In::rows(&h, hidden), norm(&w.norm_f), n, Out { buf: &mut x, offset: 0 })?;
    }
    if seqs.is_empty() {
        // Decode rows only: every row is its part's last, in order (`rows.last` is 0..nd).
        b.linear(In::rows(&x, hidden), n, &w.lm_head, Out { buf: logits, offset: 0 })?;
        marks.end(b, Stage::Head)?;
        return Ok(counters);
    }
    let picked = nd + seqs.len();
    let mut sel = b.scratch(picked * hidden)?;
    b.last_rows(&x, hidden, rows, Out { buf: &mut sel, offset: 0 })?;
    b.linear(In::rows(&sel, hidden), picked, &w.lm_head, Out { buf: logits, offset: 0 })?;
    marks.end(b, Stage::Head)?;
    Ok(counters)
}
