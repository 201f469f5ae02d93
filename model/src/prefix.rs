//! The prefix cache: a slot's state saved after a token sequence (a [`Snapshot`]: every Mamba
//! layer's conv and SSM state, every attention layer's keys and values of the sequence's
//! positions), so that a later request whose prompt starts with that sequence restores it into
//! its own slot and prefills only the rest.
//!
//! A hybrid model's recurrent state exists only at the positions it was saved at, so a
//! snapshot serves exactly the sequence it was taken after: found by the hash of its tokens,
//! then checked token by token. A hit leaves at least one prompt token to feed (the request's
//! first token is drawn from its logits). Where the engine takes snapshots
//! ([`crate::engine::Engine::set_prefix_cache`]):
//! - at the end of a prompt's prefill, and at the end of a request (its prompt and output but
//!   the last token, which was never fed): a chat's next turn starts with them;
//! - before a chat prompt's last turn start ([`PrefixSettings::turn_start`]), where its
//!   generation prompt begins: the conversation's next turn starts with what comes before it,
//!   whatever the template makes of the answer;
//! - at branch points: when a new prompt shares a longer prefix with a recent prompt than any
//!   snapshot it hits, its prefill stops there for a snapshot (one more step for that request),
//!   so the requests after it that share the prefix (a system prompt and tool list followed by
//!   unique suffixes of any length) restore all of it.
//!
//! Snapshots at fixed boundaries every N tokens (vLLM's blocks) would cost a whole state per
//! boundary (at Nano size the Mamba states alone are 46 MiB a snapshot, whatever its length)
//! and still miss the part of a shared prefix past its last boundary. A snapshot is taken only
//! where it adds at least [`PrefixSettings::min_tokens`] tokens to what its request restored or
//! saved before. Snapshots past the byte budget are evicted, least recently used first, those
//! of a prompt's or a request's end ([`Kept::End`]: a later prompt extends them only where it
//! continues that exact text) before those of its stops (branch points and turn starts, taken
//! because a later prompt shares them) until one is hit: by age alone, a turn start goes once
//! the budget's worth of snapshots is taken before its conversation's next turn, which 32
//! conversations at once taking two a turn do against a budget of about 60 (the H100 run
//! before this rule: 62 hits in 226 requests).

use std::collections::VecDeque;
use std::time::Duration;

use crate::backend::Backend;
use crate::config::Config;
use crate::error::{Error, Result};

/// The prefix cache's budget where `serve` and [`crate::text::LoadOptions`] are not told
/// another: 4 GiB, about 80 snapshots of Nemotron-3 Nano's 46 MiB of Mamba states.
pub const DEFAULT_BUDGET: usize = 4 << 30;

/// Prompts remembered for branch points (see the module's doc), and their tokens at most (the
/// newest prompt kept whatever its length): each new prompt is compared with them on the
/// engine's thread.
const HISTORY: usize = 256;
const HISTORY_TOKENS: usize = 1 << 20;

/// Snapshots held at most (each lookup compares a prompt's prefix hashes with every one).
const MAX_ENTRIES: usize = 4096;

/// What one slot's state takes, per layer kind: a snapshot's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotShape {
    pub mamba_layers: usize,
    /// Elements of one slot's conv state (bf16) and SSM state (f32) in one Mamba layer.
    pub conv: usize,
    pub ssm: usize,
    pub attention_layers: usize,
    /// Elements of one token's keys (and as many values) in one attention layer (bf16).
    pub kv: usize,
}

impl SnapshotShape {
    /// The shape of `config`'s states.
    pub fn new(config: &Config) -> SnapshotShape {
        let count = |kind| config.layers.iter().filter(|&&l| l == kind).count();
        let (conv, ssm) = config
            .mamba
            .as_ref()
            .map_or((0, 0), |c| (c.conv_dim() * c.conv_kernel.saturating_sub(1), c.inner() * c.state_size));
        SnapshotShape {
            mamba_layers: count(crate::LayerKind::Mamba),
            conv,
            ssm,
            attention_layers: count(crate::LayerKind::Attention),
            kv: config.attention.as_ref().map_or(0, |c| c.kv_heads * c.head_dim),
        }
    }

    /// Bytes of a snapshot after `len` tokens (states as the slots hold them: conv, keys and
    /// values bf16, SSM f32).
    pub fn bytes(&self, len: usize) -> usize {
        self.mamba_layers * (2 * self.conv + 4 * self.ssm) + self.attention_layers * 2 * 2 * self.kv * len
    }
}

/// A slot's state after `len` tokens, on the backend ([`crate::model::Model::save`]): the Mamba
/// layers' conv and SSM states in layer order, the attention layers' keys then values of
/// positions `0..len` in layer order.
pub struct Snapshot<B: Backend> {
    pub(crate) len: usize,
    pub(crate) shape: SnapshotShape,
    pub(crate) conv: B::Buf,
    pub(crate) ssm: B::Buf32,
    pub(crate) kv: B::Buf,
}

impl<B: Backend> Snapshot<B> {
    /// Tokens the state had seen.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is the state before any token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes it takes on the backend.
    pub fn bytes(&self) -> usize {
        self.shape.bytes(self.len)
    }
}

/// How much the prefix cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixSettings {
    /// Bytes the snapshots may take on the backend's device.
    pub budget: usize,
    /// The fewest tokens a snapshot adds to what its request restored or saved before (and so
    /// the shortest prefix saved).
    pub min_tokens: usize,
    /// The token that starts a chat turn (ChatML's `<|im_start|>`), if any: a prompt's prefill
    /// also stops before its last one (where its generation prompt starts) for a snapshot, which
    /// the conversation's next turn starts with whatever the template makes of the answer
    /// (reasoning templates drop the reasoning of earlier turns).
    pub turn_start: Option<u32>,
}

impl PrefixSettings {
    /// `budget` bytes, snapshots at least 64 tokens apart.
    pub fn bytes(budget: usize) -> PrefixSettings {
        PrefixSettings { budget, min_tokens: 64, turn_start: None }
    }
}

/// The bytes of `gib` GiB (a command line's budget): an error unless finite and at least 0.
pub fn gib_bytes(gib: f64) -> Result<usize> {
    if !(gib.is_finite() && gib >= 0.0) {
        return Err(Error::Invalid(format!("a budget of {gib} GiB: give a finite number of GiB, at least 0")));
    }
    Ok((gib * f64::from(1u32 << 30)) as usize)
}

/// What the prefix cache did since it was set up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Requests that restored a snapshot, and the prompt tokens they so skipped.
    pub hits: u64,
    pub hit_tokens: u64,
    /// Requests that found none.
    pub misses: u64,
    /// Snapshots taken, and evicted to stay within the budget.
    pub saved: u64,
    pub evictions: u64,
    /// Snapshots held now, and their bytes.
    pub entries: usize,
    pub bytes: usize,
    /// Host time the saves took (allocating the snapshots, queueing their copies), in
    /// microseconds: what they add to the steps that take them.
    pub save_us: u64,
}

struct Entry<B: Backend> {
    tokens: Vec<u32>,
    hash: u64,
    snapshot: Snapshot<B>,
    /// When it was last saved or hit (the cache's clock).
    used: u64,
    /// Why it was taken; an end's is evicted first until it is hit.
    kept: Kept,
}

/// Why a snapshot is taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kept {
    /// At a prompt's or a request's end: a later prompt starts with it only where it continues
    /// that exact text.
    End,
    /// Where a prefill stopped for it (a branch point, a turn start), or hit since: a later
    /// prompt shares it.
    Stop,
}

/// Snapshots by the token sequences they were taken after (see the module's doc).
pub struct PrefixCache<B: Backend> {
    settings: PrefixSettings,
    entries: Vec<Entry<B>>,
    /// Recent prompts, newest last, and their tokens.
    history: VecDeque<Vec<u32>>,
    history_tokens: usize,
    clock: u64,
    stats: PrefixStats,
}

/// The hash of no tokens, and of a sequence one token longer (FNV-1a over token ids).
const HASH_SEED: u64 = 0xcbf2_9ce4_8422_2325;
fn hash_step(h: u64, t: u32) -> u64 {
    (h ^ u64::from(t)).wrapping_mul(0x0000_0100_0000_01b3)
}

/// The hash of `tokens`.
fn hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(HASH_SEED, |h, &t| hash_step(h, t))
}

/// The hash of each prefix of `tokens`: element i is the hash of `tokens[..i]`.
fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = Vec::with_capacity(tokens.len() + 1);
    h.push(HASH_SEED);
    for &t in tokens {
        h.push(hash_step(*h.last().expect("seeded"), t));
    }
    h
}

impl<B: Backend> PrefixCache<B> {
    /// An empty cache.
    pub fn new(settings: PrefixSettings) -> PrefixCache<B> {
        PrefixCache {
            settings,
            entries: Vec::new(),
            history: VecDeque::new(),
            history_tokens: 0,
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn stats(&self) -> PrefixStats {
        PrefixStats { entries: self.entries.len(), bytes: self.held_bytes(), ..self.stats }
    }

    /// Bytes the snapshots held take.
    fn held_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.snapshot.bytes()).sum()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The snapshot of the longest proper prefix of `prompt` held (marked used), if any.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<&Snapshot<B>> {
        let hashes = prefix_hashes(prompt);
        let best = (self.entries.iter().enumerate())
            .filter(|(_, e)| {
                let n = e.tokens.len();
                n < prompt.len() && hashes[n] == e.hash && e.tokens[..] == prompt[..n]
            })
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i);
        let now = self.tick();
        let e = &mut self.entries[best?];
        (e.used, e.kept) = (now, Kept::Stop);
        Some(&e.snapshot)
    }

    /// A request starts, `restored` tokens of its `prompt` restored (a hit, else a miss):
    /// where its prefill stops for snapshots, in order: at the end of the longest prefix it
    /// shares with a recent prompt (a branch point), and before its last
    /// [`PrefixSettings::turn_start`] token; each short of the prompt's last token and at least
    /// `min_tokens` past the one before. Remembers the prompt.
    pub fn start(&mut self, prompt: &[u32], restored: usize) -> Vec<usize> {
        if restored > 0 {
            self.stats.hits += 1;
            self.stats.hit_tokens += restored as u64;
        } else {
            self.stats.misses += 1;
        }
        let shared = (self.history.iter()).map(|h| h.iter().zip(prompt).take_while(|(a, b)| a == b).count()).max();
        let turn = self.settings.turn_start.and_then(|t| prompt.iter().rposition(|&p| p == t));
        if prompt.len() >= self.settings.min_tokens {
            self.history_tokens += prompt.len();
            self.history.push_back(prompt.to_vec());
            while self.history.len() > 1 && (self.history.len() > HISTORY || self.history_tokens > HISTORY_TOKENS) {
                let old = self.history.pop_front().expect("not empty past the bounds");
                self.history_tokens -= old.len();
            }
        }
        let mut at: Vec<usize> = [shared, turn].into_iter().flatten().map(|p| p.min(prompt.len() - 1)).collect();
        at.sort_unstable();
        let mut stops: Vec<usize> = Vec::new();
        for p in at {
            if p >= stops.last().copied().unwrap_or(restored) + self.settings.min_tokens.max(1) {
                stops.push(p);
            }
        }
        stops
    }

    /// Whether a snapshot after `tokens` (of `bytes`, more than 0: a model with no state has
    /// nothing to restore) for `why` is wanted from a request that restored or saved `base`
    /// tokens before: it adds at least `min_tokens`, none of these tokens is held (one that is
    /// counts as used, and as a stop's where `why` is: an end another prompt stops at is a
    /// branch point), and it fits the budget, which snapshots are evicted to make room for, ends
    /// not hit first, then the least recently used (before the snapshot's own memory is taken:
    /// should that fail, they are gone).
    pub fn wants(&mut self, tokens: &[u32], base: usize, bytes: usize, why: Kept) -> bool {
        if tokens.len() < base + self.settings.min_tokens.max(1) || bytes == 0 || bytes > self.settings.budget {
            return false;
        }
        let hash = hash(tokens);
        let now = self.tick();
        if let Some(e) = self.entries.iter_mut().find(|e| e.hash == hash && e.tokens == tokens) {
            e.used = now;
            e.kept = e.kept.max(why);
            return false;
        }
        let mut held = self.held_bytes();
        while held + bytes > self.settings.budget || self.entries.len() >= MAX_ENTRIES {
            let key = |i: usize| (self.entries[i].kept, self.entries[i].used);
            let Some(old) = (0..self.entries.len()).min_by_key(|&i| key(i)) else { break };
            let e = self.entries.swap_remove(old);
            held -= e.snapshot.bytes();
            self.stats.evictions += 1;
            tracing::debug!(tokens = e.tokens.len(), bytes = e.snapshot.bytes(), "prefix cache: snapshot evicted");
        }
        true
    }

    /// Holds `snapshot`, taken after `tokens` (after [`PrefixCache::wants`] made room) for
    /// `kept`, its save having taken `took`.
    pub fn insert(&mut self, tokens: &[u32], snapshot: Snapshot<B>, kept: Kept, took: Duration) {
        let hash = hash(tokens);
        let used = self.tick();
        self.stats.saved += 1;
        self.stats.save_us += u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.entries.push(Entry { tokens: tokens.to_vec(), hash, snapshot, used, kept });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{HISTORY_TOKENS, Kept, PrefixCache, PrefixSettings, Snapshot, SnapshotShape};
    use crate::cpu::Cpu;

    const SHAPE: SnapshotShape = SnapshotShape { mamba_layers: 1, conv: 2, ssm: 3, attention_layers: 1, kv: 1 };

    fn snapshot(len: usize) -> Snapshot<Cpu> {
        Snapshot { len, shape: SHAPE, conv: Vec::new(), ssm: Vec::new(), kv: Vec::new() }
    }

    fn held(c: &mut PrefixCache<Cpu>, tokens: &[u32]) {
        kept(c, tokens, Kept::Stop);
    }

    fn kept(c: &mut PrefixCache<Cpu>, tokens: &[u32], why: Kept) {
        assert!(c.wants(tokens, 0, SHAPE.bytes(tokens.len()), why));
        c.insert(tokens, snapshot(tokens.len()), why, Duration::ZERO);
    }

    /// The longest held proper prefix wins; a prompt no longer than a snapshot cannot use it;
    /// an entry whose hash matches but whose tokens differ is no hit.
    #[test]
    fn lookups_take_the_longest_proper_prefix_checked_in_full() {
        let mut c = PrefixCache::<Cpu>::new(PrefixSettings { budget: 1 << 20, min_tokens: 2, turn_start: None });
        held(&mut c, &[1, 2, 3]);
        held(&mut c, &[1, 2, 3, 4, 5]);
        held(&mut c, &[7, 8]);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5, 6]).map(Snapshot::len), Some(5));
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]).map(Snapshot::len), Some(3));
        assert_eq!(c.lookup(&[1, 2, 3, 9]).map(Snapshot::len), Some(3));
        assert!(c.lookup(&[7, 8]).is_none() && c.lookup(&[2, 2, 3, 4]).is_none());
        c.entries[0].tokens[1] = 9;
        assert!(c.lookup(&[1, 2, 3, 9]).is_none(), "tokens are compared, not only hashes");
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.saved, s.entries), (0, 0, 3, 3), "a lookup counts nothing");
        assert_eq!(s.bytes, SHAPE.bytes(3) + SHAPE.bytes(5) + SHAPE.bytes(2));
    }

    /// Snapshots add `min_tokens` to their request's last; one held again is only marked used;
    /// past the budget the least recently used go first; one larger than the budget is refused.
    #[test]
    fn snapshots_are_wanted_within_the_budget_least_recent_evicted() {
        let mut c =
            PrefixCache::<Cpu>::new(PrefixSettings { budget: 3 * SHAPE.bytes(4), min_tokens: 4, turn_start: None });
        assert!(!c.wants(&[1, 2, 3], 0, SHAPE.bytes(3), Kept::Stop), "shorter than min_tokens");
        assert!(!c.wants(&[1, 2, 3, 4, 5, 6, 7], 4, SHAPE.bytes(7), Kept::Stop), "adds 3 to the request's last");
        held(&mut c, &[1, 2, 3, 4]);
        held(&mut c, &[2, 2, 3, 4]);
        held(&mut c, &[3, 2, 3, 4]);
        assert!(!c.wants(&[2, 2, 3, 4], 0, SHAPE.bytes(4), Kept::End), "held already");
        assert!(c.lookup(&[1, 2, 3, 4, 0]).is_some());
        held(&mut c, &[4, 2, 3, 4]);
        let firsts: Vec<u32> = c.entries.iter().map(|e| e.tokens[0]).collect();
        assert_eq!(firsts.len(), 3);
        assert!(!firsts.contains(&3), "the least recently used goes: {firsts:?}");
        assert!(!c.wants(&[9; 64], 0, 3 * SHAPE.bytes(4) + 1, Kept::Stop));
        assert_eq!(c.stats().evictions, 1);
    }

    /// An end's snapshot goes before any stop's, however recent, until a lookup hits it.
    #[test]
    fn ends_not_hit_are_evicted_first() {
        let mut c =
            PrefixCache::<Cpu>::new(PrefixSettings { budget: 2 * SHAPE.bytes(4), min_tokens: 4, turn_start: None });
        held(&mut c, &[1, 2, 3, 4]);
        kept(&mut c, &[2, 2, 3, 4], Kept::End);
        held(&mut c, &[3, 2, 3, 4]);
        let firsts = |c: &PrefixCache<Cpu>| -> Vec<u32> {
            let mut f: Vec<u32> = c.entries.iter().map(|e| e.tokens[0]).collect();
            f.sort_unstable();
            f
        };
        assert_eq!(firsts(&c), [1, 3], "the end goes, not the older stop");
        kept(&mut c, &[4, 2, 3, 4], Kept::End);
        assert!(c.lookup(&[4, 2, 3, 4, 0]).is_some());
        held(&mut c, &[5, 2, 3, 4]);
        assert_eq!(firsts(&c), [4, 5], "a hit end stays, by age among the rest");
        kept(&mut c, &[6, 2, 3, 4], Kept::End);
        assert!(!c.wants(&[6, 2, 3, 4], 0, SHAPE.bytes(4), Kept::Stop), "held already");
        kept(&mut c, &[7, 2, 3, 4], Kept::Stop);
        assert_eq!(firsts(&c), [6, 7], "an end a prompt stopped at again is a stop's, kept by age");
    }

    /// A prompt stops where it parts from the recent ones (at the longest prefix it shares with
    /// any) and before its last turn start, short of its last token, each stop `min_tokens` past
    /// what it restored and the stop before.
    #[test]
    fn prompts_stop_where_they_part_and_before_their_last_turn() {
        let settings = PrefixSettings { budget: 1 << 20, min_tokens: 3, turn_start: None };
        let mut c = PrefixCache::<Cpu>::new(settings);
        assert_eq!(c.start(&[1, 2, 3, 4, 5, 6], 0), [0usize; 0]);
        assert_eq!(c.start(&[1, 2, 3, 4, 5, 6, 7], 6), [0usize; 0]);
        let s = c.stats();
        assert_eq!((s.hits, s.hit_tokens, s.misses), (1, 6, 1), "a start counts its hit or miss");
        assert_eq!(c.start(&[1, 2, 3, 4, 9, 9], 0), [4]);
        assert_eq!(c.start(&[1, 2, 3, 4, 9, 9, 1], 4), [0usize; 0], "adds 2 to what it restored");
        assert_eq!(c.start(&[1, 2, 3, 4, 5, 6], 0), [5], "all but its last token");
        // The history keeps its newest prompts within HISTORY_TOKENS, the newest whatever it is.
        let long = vec![7; HISTORY_TOKENS + 1];
        c.start(&long, 0);
        assert_eq!((c.history.len(), c.history_tokens), (1, long.len()));
        assert_eq!(c.start(&[1, 2], 0), [0usize; 0]);
        let mut c = PrefixCache::<Cpu>::new(PrefixSettings { turn_start: Some(0), ..settings });
        assert_eq!(c.start(&[0, 1, 2, 3, 4, 0, 8, 0, 9, 9], 0), [7], "before the last turn start");
        assert_eq!(c.start(&[0, 1, 2, 3, 4, 0, 8, 0, 5, 6, 7, 0, 9], 0), [8, 11], "where it parts, then its turn");
        let again = [0, 1, 2, 3, 4, 0, 8, 0, 5, 6, 7, 0, 9, 9];
        assert_eq!(c.start(&again, 10), [13], "its last turn 1 past what it restored, then all but its last");
        assert_eq!(c.start(&[3, 3, 3, 3, 0], 0), [4]);
    }
}
