//! NemotronH on a [`Backend`]: the weights uploaded once, the state cache (conv, SSM and KV
//! state per slot), and the step that runs a batch mixing decode rows and prefill sequences.
//! This is the model's one code path; backends differ only in how they run each operation.

use half::bf16;

use crate::backend::{Backend, In, MoeWeights, Out, PrefillSeqs};
use crate::cache::{Part, StepPlan};
use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::layout::{Layout, Mixer, Mlp};

struct MambaW<B: Backend> {
    in_proj: B::Weight,
    conv_w: B::Buf,
    conv_b: Option<B::Buf>,
    dt_bias: B::Buf32,
    a: B::Buf32,
    d: B::Buf32,
    norm: B::Buf,
    out_proj: B::Weight,
}

enum MixW<B: Backend> {
    Mamba(Box<MambaW<B>>),
    Moe(MoeWeights<B>),
    Attention { q: B::Weight, k: B::Weight, v: B::Weight, o: B::Weight },
    Mlp { up: B::Weight, down: B::Weight },
}

enum LayerCache<B: Backend> {
    Mamba { conv: B::Buf, ssm: B::Buf32 },
    Attention { k: B::Buf, v: B::Buf },
    Stateless,
}

/// What one step ran, counted at the call sites: decode rows must go through the update
/// kernels and prefill rows through the forward / scan kernels, and nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounters {
    pub conv_updates: usize,
    pub conv_forwards: usize,
    pub state_updates: usize,
    pub chunk_scans: usize,
    pub attention_calls: usize,
    pub moe_calls: usize,
}

/// A loaded model with its state cache.
pub struct Model<B: Backend> {
    backend: B,
    config: Config,
    embeddings: B::Buf,
    layers: Vec<(B::Buf, MixW<B>)>,
    norm_f: B::Buf,
    lm_head: B::Weight,
    cache: Vec<LayerCache<B>>,
    /// Tokens each slot's state has seen.
    past: Vec<usize>,
    max_len: usize,
    counters: StepCounters,
}

fn bf16s<B: Backend>(b: &B, t: &crate::weights::Tensor) -> Result<B::Buf> {
    b.upload(&t.to_bf16()?)
}

/// A dense MLP's two weights.
pub(crate) fn mlp<B: Backend>(b: &B, m: &Mlp) -> Result<(B::Weight, B::Weight)> {
    Ok((b.weight(&m.up)?, b.weight(&m.down)?))
}

impl<B: Backend> Model<B> {
    /// Uploads every weight of `layout` and allocates a state cache of `slots` slots, each
    /// holding up to `max_len` tokens of attention keys and values.
    pub fn load(backend: B, config: &Config, layout: &Layout, slots: usize, max_len: usize) -> Result<Model<B>> {
        Model::load_with_progress(backend, config, layout, slots, max_len, &mut |_, _| {})
    }

    /// [`Model::load`], calling `progress(layers_done, layers)` after each layer's weights.
    pub fn load_with_progress(
        backend: B,
        config: &Config,
        layout: &Layout,
        slots: usize,
        max_len: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>> {
        let b = &backend;
        let mut layers = Vec::new();
        let mut cache = Vec::new();
        let total = layout.layers.len();
        for layer in &layout.layers {
            let (mix, lc) = match &layer.mixer {
                Mixer::Mamba(m) => {
                    let c = config.mamba.as_ref().ok_or_else(|| Error::Unsupported("mamba settings missing".into()))?;
                    let a: Vec<f32> = m.a_log.to_f32()?.into_iter().map(|v| -v.exp()).collect();
                    let w = MambaW {
                        in_proj: b.weight(&m.in_proj)?,
                        conv_w: bf16s(b, &m.conv_w)?,
                        conv_b: m.conv_b.as_ref().map(|t| bf16s(b, t)).transpose()?,
                        dt_bias: b.upload32(&m.dt_bias.to_f32()?)?,
                        a: b.upload32(&a)?,
                        d: b.upload32(&m.d.to_f32()?)?,
                        norm: bf16s(b, &m.norm)?,
                        out_proj: b.weight(&m.out_proj)?,
                    };
                    let lc = LayerCache::Mamba {
                        conv: b.zeros(slots * c.conv_dim() * (c.conv_kernel - 1))?,
                        ssm: b.zeros32(slots * c.inner() * c.state_size)?,
                    };
                    (MixW::Mamba(Box::new(w)), lc)
                }
                Mixer::Moe(m) => {
                    let experts = config.moe.as_ref().map_or(0, |c| c.experts);
                    let bias = match &m.score_bias {
                        Some(t) => t.to_f32()?,
                        None => vec![0.0; experts],
                    };
                    let w = MoeWeights {
                        gate: bf16s(b, &m.gate)?,
                        score_bias: b.upload32(&bias)?,
                        experts: b.experts(&m.experts)?,
                        shared: m.shared.as_ref().map(|s| mlp(b, s)).transpose()?,
                    };
                    (MixW::Moe(w), LayerCache::Stateless)
                }
                Mixer::Attention(a) => {
                    let c = config
                        .attention
                        .as_ref()
                        .ok_or_else(|| Error::Unsupported("attention settings missing".into()))?;
                    let kv = slots * max_len * c.kv_heads * c.head_dim;
                    let w = MixW::Attention {
                        q: b.weight(&a.q)?,
                        k: b.weight(&a.k)?,
                        v: b.weight(&a.v)?,
                        o: b.weight(&a.o)?,
                    };
                    (w, LayerCache::Attention { k: b.zeros(kv)?, v: b.zeros(kv)? })
                }
                Mixer::Mlp(m) => {
                    let (up, down) = mlp(b, m)?;
                    (MixW::Mlp { up, down }, LayerCache::Stateless)
                }
            };
            layers.push((bf16s(b, &layer.norm)?, mix));
            cache.push(lc);
            progress(layers.len(), total);
        }
        Ok(Model {
            embeddings: bf16s(b, &layout.embeddings)?,
            norm_f: bf16s(b, &layout.norm_f)?,
            lm_head: b.weight(&layout.lm_head)?,
            layers,
            cache,
            past: vec![0; slots],
            max_len,
            config: config.clone(),
            counters: StepCounters::default(),
            backend,
        })
    }

    /// What the last step ran.
    pub fn counters(&self) -> StepCounters {
        self.counters
    }

    /// Runs one step over `parts` (requests' new tokens, each at its slot) and returns the
    /// logits after each part's last token, in the order of `parts`.
    pub fn step(&mut self, parts: &[Part]) -> Result<Vec<Vec<f32>>> {
        let plan = StepPlan::new(parts)?;
        let slots = self.past.len();
        let mut seen = vec![false; slots];
        for (i, p) in parts.iter().enumerate() {
            if p.slot < 0 || p.slot as usize >= slots || std::mem::replace(&mut seen[p.slot as usize], true) {
                return Err(Error::Capacity(format!(
                    "part {i}: slot {} is out of range (0..{slots}) or used twice",
                    p.slot
                )));
            }
            if p.computed > 0 && p.computed != self.past[p.slot as usize] {
                return Err(Error::Unsupported(format!(
                    "part {i}: {} tokens computed, but slot {} holds the state of {}",
                    p.computed, p.slot, self.past[p.slot as usize]
                )));
            }
        }
        let b = &self.backend;
        let hidden = self.config.hidden_size;
        let eps = self.config.norm_eps;
        let nd = plan.decode_tokens.len();
        let rows = plan.rows();
        let seqs = PrefillSeqs {
            lens: plan.prefill_lens.clone(),
            slots: plan.prefill_slots.clone(),
            initial: plan.prefill_initial.clone(),
        };
        // Attention groups: each decode row is a sequence of one; then the prefill sequences.
        let att_lens: Vec<usize> = std::iter::repeat_n(1, nd).chain(seqs.lens.iter().copied()).collect();
        let att_slots: Vec<i32> = plan.decode_slots.iter().chain(&seqs.slots).copied().collect();
        let att_past: Vec<usize> = plan
            .decode_slots
            .iter()
            .map(|&s| self.past[s as usize])
            .chain(seqs.slots.iter().zip(&seqs.initial).map(|(&s, &i)| if i { self.past[s as usize] } else { 0 }))
            .collect();
        let mut counters = StepCounters::default();

        let tokens: Vec<u32> = plan.decode_tokens.iter().chain(&plan.prefill_tokens).copied().collect();
        let mut h = b.zeros(rows * hidden)?;
        b.embed(&self.embeddings, hidden, &tokens, Out { buf: &mut h, offset: 0 })?;
        let mut x = b.zeros(rows * hidden)?;
        let mut out = b.zeros(rows * hidden)?;
        for (((norm, mix), lc), kind) in self.layers.iter().zip(&mut self.cache).zip(&self.config.layers) {
            b.rms_norm(In::rows(&h, hidden), norm, rows, hidden, eps, Out { buf: &mut x, offset: 0 })?;
            match (mix, lc) {
                (MixW::Mamba(m), LayerCache::Mamba { conv, ssm }) => {
                    let c = self.config.mamba.as_ref().expect("mamba layers come with mamba settings");
                    let (inner, cd, wd) = (c.inner(), c.conv_dim(), c.in_proj_width());
                    let mut zx = b.zeros(rows * wd)?;
                    b.linear(In::rows(&x, hidden), rows, &m.in_proj, Out { buf: &mut zx, offset: 0 })?;
                    let zxr = In::rows(&zx, wd);
                    let mut xbc = b.zeros(rows * cd)?;
                    let heads = (&m.dt_bias, &m.a, &m.d);
                    let mut y = b.zeros(rows * inner)?;
                    if nd > 0 {
                        b.conv_decode(
                            c,
                            zxr.at(0, inner),
                            &m.conv_w,
                            m.conv_b.as_ref(),
                            conv,
                            &plan.decode_slots,
                            Out { buf: &mut xbc, offset: 0 },
                        )?;
                        let xbcr = In::rows(&xbc, cd);
                        b.ssm_decode(
                            c,
                            xbcr,
                            zxr.at(0, inner + cd),
                            heads,
                            ssm,
                            &plan.decode_slots,
                            Out { buf: &mut y, offset: 0 },
                        )?;
                        counters.conv_updates += 1;
                        counters.state_updates += 1;
                    }
                    if !seqs.lens.is_empty() {
                        b.conv_prefill(
                            c,
                            zxr.at(nd, inner),
                            &m.conv_w,
                            m.conv_b.as_ref(),
                            conv,
                            &seqs,
                            Out { buf: &mut xbc, offset: nd * cd },
                        )?;
                        let xbcr = In::rows(&xbc, cd).at(nd, 0);
                        b.ssm_prefill(
                            c,
                            xbcr,
                            zxr.at(nd, inner + cd),
                            heads,
                            ssm,
                            &seqs,
                            Out { buf: &mut y, offset: nd * inner },
                        )?;
                        counters.conv_forwards += 1;
                        counters.chunk_scans += 1;
                    }
                    let mut yn = b.zeros(rows * inner)?;
                    b.gated_norm(
                        In::rows(&y, inner),
                        zxr,
                        &m.norm,
                        rows,
                        inner,
                        c.groups,
                        eps,
                        Out { buf: &mut yn, offset: 0 },
                    )?;
                    b.linear(In::rows(&yn, inner), rows, &m.out_proj, Out { buf: &mut out, offset: 0 })?;
                }
                (MixW::Moe(w), _) => {
                    let c = self.config.moe.as_ref().expect("moe layers come with moe settings");
                    b.moe(c, In::rows(&x, hidden), rows, w, Out { buf: &mut out, offset: 0 })?;
                    counters.moe_calls += 1;
                }
                (MixW::Attention { q, k, v, o }, LayerCache::Attention { k: kc, v: vc }) => {
                    let c = self.config.attention.as_ref().expect("attention layers come with attention settings");
                    let (qw, kw) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                    let (mut qb, mut kb, mut vb) = (b.zeros(rows * qw)?, b.zeros(rows * kw)?, b.zeros(rows * kw)?);
                    let xr = In::rows(&x, hidden);
                    b.linear(xr, rows, q, Out { buf: &mut qb, offset: 0 })?;
                    b.linear(xr, rows, k, Out { buf: &mut kb, offset: 0 })?;
                    b.linear(xr, rows, v, Out { buf: &mut vb, offset: 0 })?;
                    let mut att = b.zeros(rows * qw)?;
                    b.attention(
                        c,
                        In::rows(&qb, qw),
                        In::rows(&kb, kw),
                        In::rows(&vb, kw),
                        (kc, vc),
                        self.max_len,
                        (&att_lens, &att_slots, &att_past),
                        Out { buf: &mut att, offset: 0 },
                    )?;
                    b.linear(In::rows(&att, qw), rows, o, Out { buf: &mut out, offset: 0 })?;
                    counters.attention_calls += 1;
                }
                (MixW::Mlp { up, down }, _) => {
                    let inter = self.config.mlp_intermediate.expect("mlp layers come with intermediate_size");
                    let mut u = b.zeros(rows * inter)?;
                    b.linear(In::rows(&x, hidden), rows, up, Out { buf: &mut u, offset: 0 })?;
                    b.relu2(&mut u, rows * inter)?;
                    b.linear(In::rows(&u, inter), rows, down, Out { buf: &mut out, offset: 0 })?;
                }
                _ => unreachable!("layer {kind:?}: caches are built from the same layers"),
            }
            b.add(&mut h, &out, rows * hidden)?;
        }
        b.rms_norm(In::rows(&h, hidden), &self.norm_f, rows, hidden, eps, Out { buf: &mut x, offset: 0 })?;
        // The last row of each part: decode rows, then each prefill sequence's end.
        let mut last: Vec<u32> = (0..nd as u32).collect();
        let mut end = nd;
        for &l in &seqs.lens {
            end += l;
            last.push(end as u32 - 1);
        }
        let mut sel = b.zeros(last.len() * hidden)?;
        b.embed(&x, hidden, &last, Out { buf: &mut sel, offset: 0 })?;
        let vocab = self.config.vocab_size;
        let mut logits = b.zeros(last.len() * vocab)?;
        b.linear(In::rows(&sel, hidden), last.len(), &self.lm_head, Out { buf: &mut logits, offset: 0 })?;
        let logits: Vec<bf16> = b.download(&logits)?;

        for (&s, n) in plan.decode_slots.iter().zip(std::iter::repeat(1)) {
            self.past[s as usize] += n;
        }
        for ((&s, &l), &i) in seqs.slots.iter().zip(&seqs.lens).zip(&seqs.initial) {
            self.past[s as usize] = if i { self.past[s as usize] } else { 0 } + l;
        }
        self.counters = counters;
        let mut by_part = vec![Vec::new(); parts.len()];
        for (j, &part) in plan.order.iter().enumerate() {
            by_part[part] = logits[j * vocab..(j + 1) * vocab].iter().map(|v| v.to_f32()).collect();
        }
        Ok(by_part)
    }

    /// Forgets a slot's state (its next part must start with `computed == 0`).
    pub fn release(&mut self, slot: i32) {
        if let Some(p) = self.past.get_mut(slot.max(0) as usize) {
            *p = 0;
        }
    }

    /// The layer kinds, in order.
    pub fn layers(&self) -> &[LayerKind] {
        &self.config.layers
    }

    /// Slots in the state cache.
    pub fn slots(&self) -> usize {
        self.past.len()
    }

    /// Most tokens a slot holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.config.vocab_size
    }
}
