//! From generated token ids to text, a token at a time: [`Detok`] decodes incrementally
//! (holding back a character whose bytes are not all there yet), skipping special tokens but
//! the output parser's tags; [`token_bytes`] is one token's own bytes (logprobs' `bytes`).

use std::collections::HashMap;
use std::sync::Arc;

use tokenizers::{AddedToken, DecoderWrapper, Tokenizer};

/// Prompt tokens decoded before the first generated one, so that it decodes in context (a
/// leading space kept, say).
const CONTEXT: usize = 4;

/// The tags [`super::OutputParser`] reads, kept in the text even where the tokenizer marks
/// them special (vLLM's parsers for this model read them as text too).
const PARSER_TAGS: [&str; 4] = ["<think>", "</think>", "<tool_call>", "</tool_call>"];

/// Incremental detokenizer: the text of the tokens pushed so far, as deltas. It decodes the
/// tokens since the last emitted delta together with the ones before it, and emits what the
/// newer decoding adds, unless it ends in U+FFFD (a character not complete yet). Special
/// tokens are skipped (the eos token, say), except the [`PARSER_TAGS`]: a run of tokens is
/// decoded between them and each is its own text.
pub struct Detok {
    tokenizer: Arc<Tokenizer>,
    /// The parser tags the tokenizer marks special: (id, text).
    tags: Vec<(u32, &'static str)>,
    ids: Vec<u32>,
    /// `ids[prefix..read]` were decoded for the last delta; `ids[read..]` are not emitted yet.
    prefix: usize,
    read: usize,
}

impl Detok {
    /// A detokenizer for the tokens generated after `prompt`.
    pub fn new(tokenizer: Arc<Tokenizer>, prompt: &[u32]) -> Detok {
        let ids = prompt[prompt.len().saturating_sub(CONTEXT)..].to_vec();
        let read = ids.len();
        let added = tokenizer.get_added_tokens_decoder();
        let tags = (PARSER_TAGS.iter())
            .filter_map(|&tag| {
                let id = tokenizer.token_to_id(tag)?;
                added.get(&id).is_some_and(|t| t.special).then_some((id, tag))
            })
            .collect();
        Detok { tokenizer, tags, ids, prefix: 0, read }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        let decode = |ids: &[u32]| self.tokenizer.decode(ids, true).map_err(|e| format!("detokenizing: {e}"));
        if self.tags.is_empty() {
            return decode(ids);
        }
        let mut text = String::new();
        for run in ids.split_inclusive(|id| self.tags.iter().any(|t| t.0 == *id)) {
            match run.split_last().and_then(|(last, rest)| Some((self.tags.iter().find(|t| t.0 == *last)?.1, rest))) {
                Some((tag, rest)) => {
                    text += &decode(rest)?;
                    text += tag;
                }
                None => text += &decode(run)?,
            }
        }
        Ok(text)
    }

    /// The text `id` adds (empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String, String> {
        self.ids.push(id);
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        match now.get(before.len()..) {
            Some(delta) if !delta.is_empty() && !now.ends_with('\u{FFFD}') => {
                let delta = delta.to_string();
                self.prefix = self.read;
                self.read = self.ids.len();
                Ok(delta)
            }
            _ => Ok(String::new()),
        }
    }

    /// What is still held back (an incomplete character, decoded lossily), at the end.
    pub fn finish(&mut self) -> Result<String, String> {
        let before = self.decode(&self.ids[self.prefix..self.read])?;
        let now = self.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// Each token's own bytes, for one tokenizer (its added tokens and decoder read once).
pub struct TokenBytes<'a> {
    tokenizer: &'a Tokenizer,
    added: HashMap<u32, AddedToken>,
    byte_level: bool,
    byte_fallback: bool,
}

impl<'a> TokenBytes<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> TokenBytes<'a> {
        let decoders = match tokenizer.get_decoder() {
            Some(DecoderWrapper::Sequence(seq)) => seq.get_decoders().iter().collect(),
            Some(d) => vec![d],
            None => vec![],
        };
        let has = |f: fn(&DecoderWrapper) -> bool| decoders.iter().any(|d| f(d));
        TokenBytes {
            tokenizer,
            added: tokenizer.get_added_tokens_decoder().into_iter().collect(),
            byte_level: has(|d| matches!(d, DecoderWrapper::ByteLevel(_))),
            byte_fallback: has(|d| matches!(d, DecoderWrapper::ByteFallback(_))),
        }
    }

    /// Token `id`'s bytes: an added token's content; under a byte-level decoder (GPT-2's,
    /// which the Nemotron tokenizers use) each character of the vocabulary entry mapped back to
    /// its byte; under byte fallback a `<0xNN>` entry's byte, another entry with `▁` as a
    /// space; otherwise the token decoded alone.
    pub fn of(&self, id: u32) -> Vec<u8> {
        if let Some(added) = self.added.get(&id) {
            return added.content.clone().into_bytes();
        }
        let decoded = || self.tokenizer.decode(&[id], false).unwrap_or_default().into_bytes();
        let Some(entry) = self.tokenizer.id_to_token(id) else { return decoded() };
        if self.byte_level
            && let Some(bytes) = entry.chars().map(byte_level).collect::<Option<Vec<u8>>>()
        {
            return bytes;
        }
        if self.byte_fallback {
            let hex = entry.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
            if let Some(b) = hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
                return vec![b];
            }
            return entry.replace('\u{2581}', " ").into_bytes();
        }
        decoded()
    }

    /// The added token `id`, if it is one.
    pub fn added(&self, id: u32) -> Option<&AddedToken> {
        self.added.get(&id)
    }
}

/// The byte a byte-level vocabulary character stands for (GPT-2's table: the printable bytes
/// `!`..=`~`, U+00A1..=U+00AC and U+00AE..=U+00FF as themselves, the other 68 bytes in order
/// as U+0100 onwards).
fn byte_level(c: char) -> Option<u8> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let c = c as u32;
    if c < 0x100 {
        return printable(c).then_some(c as u8);
    }
    (0u32..=0xff).filter(|&b| !printable(b)).nth((c - 0x100) as usize).map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's `bytes_to_unicode`, written from its definition: each byte's character.
    fn gpt2_table() -> Vec<char> {
        let mut next = 0x100;
        (0u32..=0xff)
            .map(|b| match b {
                0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff => char::from_u32(b).unwrap(),
                _ => {
                    next += 1;
                    char::from_u32(next - 1).unwrap()
                }
            })
            .collect()
    }

    #[test]
    fn byte_level_characters_map_back_to_their_bytes() {
        let table = gpt2_table();
        assert_eq!(table.len(), 256);
        for (b, &c) in table.iter().enumerate() {
            assert_eq!(byte_level(c), Some(b as u8), "byte {b} as {c:?}");
        }
        assert_eq!(byte_level('\u{144}'), None, "past the 68 remapped bytes");
        assert_eq!(byte_level(' '), None, "a space is never a byte-level character");
    }

    #[test]
    fn a_token_of_part_of_a_character_gives_its_own_bytes() {
        // The built-in tokenizer is byte-level: a token per byte, ChatML's markers added.
        let dir = crate::built_in::dir().unwrap();
        let tok = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let euro = "€".as_bytes();
        let ids = tok.encode("€", false).unwrap().get_ids().to_vec();
        assert_eq!(ids.len(), 3, "one token a byte");
        let of = TokenBytes::new(&tok);
        let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| of.of(id)).collect();
        assert_eq!(bytes, euro.iter().map(|&b| vec![b]).collect::<Vec<_>>());
        // Decoded alone such a token is U+FFFD, whose bytes are not the token's.
        assert_eq!(tok.decode(&ids[..1], false).unwrap(), "\u{fffd}");
        let space = tok.encode(" ", false).unwrap().get_ids()[0];
        assert_eq!(of.of(space), b" ");
        let end = tok.token_to_id("<|im_end|>").unwrap();
        assert_eq!(of.of(end), b"<|im_end|>");
        let mut seen = [false; 256];
        for id in 0..256u32 {
            let b = of.of(id);
            assert_eq!(b.len(), 1, "token {id}");
            seen[b[0] as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "the 256 byte tokens cover every byte");
    }

    /// Under byte fallback (SentencePiece's vocabularies), a `<0xNN>` entry is its byte and
    /// another entry its text with `▁` as a space, a leading one kept (decoded alone, the
    /// decoder's Strip would drop it).
    #[test]
    fn byte_fallback_entries_give_their_bytes() {
        let json = r#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
            "post_processor": null, "truncation": null, "padding": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                "vocab": {"<unk>": 0, "<0x41>": 1, "\u2581Hello": 2, "wor\u2581ld": 3}, "merges": []}}"#;
        let tok: Tokenizer = json.parse().unwrap();
        assert_eq!(tok.decode(&[2], false).unwrap(), "Hello", "decoded alone, the space is stripped");
        let bytes = TokenBytes::new(&tok);
        assert_eq!([bytes.of(1), bytes.of(2), bytes.of(3)], [b"A".to_vec(), b" Hello".to_vec(), b"wor ld".to_vec()]);
    }
}
