//! From generated token ids to text, a token at a time: [`Detok`] decodes incrementally
//! (holding back a character whose bytes are not all there yet).

use std::sync::Arc;

use tokenizers::Tokenizer;

/// Prompt tokens decoded before the first generated one, so that it decodes in context (a
/// leading space kept, say).
const CONTEXT: usize = 4;

/// Incremental detokenizer: the text of the tokens pushed so far, as deltas. It decodes the
/// tokens since the last emitted delta together with the ones before it, and emits what the
/// newer decoding adds, unless it ends in U+FFFD (a character not complete yet).
pub struct Detok {
    tokenizer: Arc<Tokenizer>,
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
        Detok { tokenizer, ids, prefix: 0, read }
    }

    fn decode(&self, ids: &[u32]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| format!("detokenizing: {e}"))
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
