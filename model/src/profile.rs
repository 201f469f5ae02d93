//! Where a step's time goes. With profiling on ([`crate::model::Model::set_profiling`]) the
//! model stamps the backend's queue of work ([`crate::backend::Backend::stamp`]) after each
//! part of a step: the embedding, each part of each layer, the LM head. A [`Profile`] holds the
//! time from each stamp to the next, labelled with what ran between them ([`Stage`]), and sums
//! it by layer kind ([`Profile::by_group`]) and by part of a layer ([`Profile::parts`]).
//!
//! On the CUDA backend a stamp is a CUDA event on the stream, so a span is GPU time (any host
//! wait inside it, such as a MoE layer reading its expert offsets back, included); on the CPU
//! backend, which runs each operation as it is called, the host clock.
//!
//! With the expert tally on ([`crate::model::Model::set_expert_tally`]) a step also reads back
//! each MoE layer's routing: an [`ExpertLoad`] a layer, the rows each expert got.

use crate::config::LayerKind;
use crate::error::{Error, Result};

/// What ran between two stamps of a profiled step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The embedding lookup and the first layer's RMSNorm.
    Embed,
    /// A part of layer `index`, of kind `kind`.
    Layer { index: usize, kind: LayerKind, part: Part },
    /// The gather of each part's last row (a step with prefill) and the LM head. The final norm
    /// is fused into the last layer's residual add ([`Part::Residual`]); it is here only in a
    /// model without layers.
    Head,
    /// The sampling launch (a step with sampling rows).
    Sample,
}

/// A part of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Mamba: the input projection (z, xBC, dt).
    InProj,
    /// Mamba, decode rows: conv update, state update and gated norm (one launch or three).
    Decode,
    /// Mamba, prefill sequences: the causal conv1d forward.
    Conv,
    /// Mamba, prefill sequences: the chunked scan.
    Scan,
    /// Mamba, prefill sequences: the gated group RMSNorm.
    GatedNorm,
    /// Mamba: the output projection.
    OutProj,
    /// Attention: the q, k and v projections.
    Qkv,
    /// Attention: the KV-cache write and the causal attention.
    Attend,
    /// Attention: the output projection.
    OProj,
    /// MoE: routing, routed experts, shared expert and combine.
    Moe,
    /// Dense MLP: both projections.
    Mlp,
    /// Every layer: the residual add and the next layer's RMSNorm (the final norm after the
    /// last layer).
    Residual,
}

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::InProj => "in_proj",
            Part::Decode => "decode mixer",
            Part::Conv => "conv1d",
            Part::Scan => "chunked scan",
            Part::GatedNorm => "gated norm",
            Part::OutProj => "out_proj",
            Part::Qkv => "qkv_proj",
            Part::Attend => "attention",
            Part::OProj => "o_proj",
            Part::Moe => "routing + experts",
            Part::Mlp => "mlp",
            Part::Residual => "residual + norm",
        }
    }
}

/// What a line of [`Profile::by_group`] sums.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Group {
    Embed,
    Layers(LayerKind),
    Head,
    Sample,
}

impl Group {
    pub fn name(self) -> &'static str {
        match self {
            Group::Embed => "embedding",
            Group::Layers(LayerKind::Mamba) => "mamba",
            Group::Layers(LayerKind::Moe) => "moe",
            Group::Layers(LayerKind::Attention) => "attention",
            Group::Layers(LayerKind::Mlp) => "dense mlp",
            Group::Head => "lm head",
            Group::Sample => "sampling",
        }
    }

    fn of(stage: &Stage) -> Group {
        match *stage {
            Stage::Embed => Group::Embed,
            Stage::Layer { kind, .. } => Group::Layers(kind),
            Stage::Head => Group::Head,
            Stage::Sample => Group::Sample,
        }
    }
}

/// The summed time of one [`Group`]: its layers (0 for the groups that are not layers) and
/// milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupTime {
    pub group: Group,
    pub layers: usize,
    pub ms: f64,
}

/// One span of a profiled step: what ran, and for how long.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub stage: Stage,
    pub ms: f64,
}

/// The spans of one profiled step, in the order they ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    pub spans: Vec<Span>,
}

/// How one MoE layer's routing spread a tallied step's rows over its routed experts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExpertLoad {
    /// The layer's index in the model.
    pub layer: usize,
    /// The rows routed to each expert (a row counts once for each of its top-k choices).
    pub rows: Vec<usize>,
}

impl ExpertLoad {
    /// The load of `choices` (every row's routed expert ids) on layer `layer`'s `experts`
    /// experts; an id past them is an error.
    pub fn of(layer: usize, experts: usize, choices: &[u32]) -> Result<ExpertLoad> {
        let mut rows = vec![0; experts];
        for &e in choices {
            *rows.get_mut(e as usize).ok_or_else(|| {
                Error::Unsupported(format!("layer {layer}'s routing chose expert {e} of {experts}"))
            })? += 1;
        }
        Ok(ExpertLoad { layer, rows })
    }

    /// Experts with at least one row.
    pub fn touched(&self) -> usize {
        self.rows.iter().filter(|&&n| n > 0).count()
    }

    /// The most rows an expert got.
    pub fn largest(&self) -> usize {
        self.rows.iter().copied().max().unwrap_or(0)
    }
}

/// The order groups are listed in.
const GROUPS: [Group; 7] = [
    Group::Embed,
    Group::Layers(LayerKind::Mamba),
    Group::Layers(LayerKind::Moe),
    Group::Layers(LayerKind::Attention),
    Group::Layers(LayerKind::Mlp),
    Group::Head,
    Group::Sample,
];

impl Profile {
    /// The time of every span.
    pub fn total_ms(&self) -> f64 {
        self.spans.iter().map(|s| s.ms).sum()
    }

    /// The spans summed by group: the embedding, each layer kind (with its number of layers),
    /// the LM head, sampling; the groups the step ran, in that order.
    pub fn by_group(&self) -> Vec<GroupTime> {
        GROUPS
            .iter()
            .filter_map(|&group| {
                let spans: Vec<&Span> = self.spans.iter().filter(|s| Group::of(&s.stage) == group).collect();
                let mut layers: Vec<usize> = spans
                    .iter()
                    .filter_map(|s| match s.stage {
                        Stage::Layer { index, .. } => Some(index),
                        _ => None,
                    })
                    .collect();
                layers.sort_unstable();
                layers.dedup();
                let ms = spans.iter().map(|s| s.ms).sum();
                (!spans.is_empty()).then_some(GroupTime { group, layers: layers.len(), ms })
            })
            .collect()
    }

    /// The parts of the layers of `kind`, each summed over those layers, in the order they
    /// first ran.
    pub fn parts(&self, kind: LayerKind) -> Vec<(Part, f64)> {
        let mut parts: Vec<(Part, f64)> = Vec::new();
        for s in &self.spans {
            if let Stage::Layer { kind: k, part, .. } = s.stage
                && k == kind
            {
                match parts.iter_mut().find(|(p, _)| *p == part) {
                    Some((_, ms)) => *ms += s.ms,
                    None => parts.push((part, s.ms)),
                }
            }
        }
        parts
    }

    /// Span by span, the median of `runs`' times (the upper one of an even count): profiles
    /// of the same step, whose spans must be the same stages in the same order.
    pub fn median(runs: &[Profile]) -> Result<Profile> {
        let Some(first) = runs.first() else {
            return Err(Error::Unsupported("the median of no profiles".into()));
        };
        if let Some((i, _)) = runs.iter().enumerate().find(|(_, r)| {
            r.spans.len() != first.spans.len() || r.spans.iter().zip(&first.spans).any(|(a, b)| a.stage != b.stage)
        }) {
            return Err(Error::Unsupported(format!(
                "profile {i} ran other stages than profile 0 ({} spans against {}): not the same step",
                runs[i].spans.len(),
                first.spans.len()
            )));
        }
        let spans = (0..first.spans.len())
            .map(|j| {
                let mut t: Vec<f64> = runs.iter().map(|r| r.spans[j].ms).collect();
                t.sort_by(f64::total_cmp);
                Span { stage: first.spans[j].stage, ms: t[t.len() / 2] }
            })
            .collect();
        Ok(Profile { spans })
    }
}

#[cfg(test)]
mod tests {
    use super::{ExpertLoad, Group, GroupTime, Part, Profile, Span, Stage};
    use crate::config::LayerKind;

    fn layer(index: usize, kind: LayerKind, part: Part, ms: f64) -> Span {
        Span { stage: Stage::Layer { index, kind, part }, ms }
    }

    /// Embedding, a Mamba layer, a MoE layer, a second Mamba layer, the head.
    fn step(scale: f64) -> Profile {
        use LayerKind::{Mamba, Moe};
        let spans = vec![
            Span { stage: Stage::Embed, ms: 0.5 * scale },
            layer(0, Mamba, Part::InProj, 1.0 * scale),
            layer(0, Mamba, Part::Conv, 0.25 * scale),
            layer(0, Mamba, Part::Scan, 2.0 * scale),
            layer(0, Mamba, Part::Residual, 0.125 * scale),
            layer(1, Moe, Part::Moe, 4.0 * scale),
            layer(1, Moe, Part::Residual, 0.125 * scale),
            layer(2, Mamba, Part::InProj, 1.5 * scale),
            layer(2, Mamba, Part::Conv, 0.25 * scale),
            layer(2, Mamba, Part::Scan, 3.0 * scale),
            layer(2, Mamba, Part::Residual, 0.125 * scale),
            Span { stage: Stage::Head, ms: 8.0 * scale },
        ];
        Profile { spans }
    }

    #[test]
    fn spans_sum_by_layer_kind_and_by_part() {
        let p = step(1.0);
        assert_eq!(p.total_ms(), 20.875);
        let groups = p.by_group();
        let want = [
            GroupTime { group: Group::Embed, layers: 0, ms: 0.5 },
            GroupTime { group: Group::Layers(LayerKind::Mamba), layers: 2, ms: 8.25 },
            GroupTime { group: Group::Layers(LayerKind::Moe), layers: 1, ms: 4.125 },
            GroupTime { group: Group::Head, layers: 0, ms: 8.0 },
        ];
        assert_eq!(groups, want);
        assert_eq!(groups.iter().map(|g| g.ms).sum::<f64>(), p.total_ms(), "every span in one group");
        assert_eq!(
            p.parts(LayerKind::Mamba),
            [(Part::InProj, 2.5), (Part::Conv, 0.5), (Part::Scan, 5.0), (Part::Residual, 0.25)]
        );
        assert_eq!(p.parts(LayerKind::Moe), [(Part::Moe, 4.0), (Part::Residual, 0.125)]);
        assert!(p.parts(LayerKind::Attention).is_empty());
    }

    #[test]
    fn expert_load_counts_each_choice() {
        let load = ExpertLoad::of(3, 5, &[4, 0, 4, 2, 4, 0]).unwrap();
        assert_eq!(load, ExpertLoad { layer: 3, rows: vec![2, 0, 1, 0, 3] });
        assert_eq!((load.touched(), load.largest()), (3, 3));
        assert_eq!(ExpertLoad::of(0, 4, &[]).unwrap().touched(), 0);
        let err = ExpertLoad::of(7, 4, &[1, 4]).unwrap_err().to_string();
        assert!(err.contains("layer 7") && err.contains("expert 4 of 4"), "{err}");
    }

    #[test]
    fn median_is_taken_span_by_span() {
        // Span 0's median is run 1's, span 1's run 0's, the others run 2's.
        let runs = [step(1.0), step(3.0), step(2.0)];
        let mut mixed = runs.clone();
        mixed[0].spans[0].ms = 10.0;
        mixed[2].spans[1].ms = 0.0;
        let m = Profile::median(&mixed).unwrap();
        assert_eq!(m.spans.len(), 12);
        assert_eq!(m.spans[0].ms, 1.5, "median of 10, 1.5, 1");
        assert_eq!(m.spans[1].ms, 1.0, "median of 1, 3, 0");
        let want = [&mixed[1].spans[..1], &mixed[0].spans[1..2], &runs[2].spans[2..]].concat();
        assert_eq!(m, Profile { spans: want });
        assert_eq!(Profile::median(&runs[..1]).unwrap(), runs[0]);
        assert_eq!(Profile::median(&runs[..2]).unwrap(), runs[1], "the upper of two");
    }

    #[test]
    fn median_refuses_profiles_of_other_steps() {
        assert!(Profile::median(&[]).is_err());
        let mut shorter = step(1.0);
        shorter.spans.pop();
        let err = Profile::median(&[step(1.0), shorter]).unwrap_err().to_string();
        assert!(err.contains("profile 1") && err.contains("11 spans against 12"), "{err}");
        let mut other = step(1.0);
        other.spans[1].stage = Stage::Layer { index: 0, kind: LayerKind::Attention, part: Part::Qkv };
        assert!(Profile::median(&[step(1.0), other]).is_err());
    }
}
