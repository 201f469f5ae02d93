//! From generated token ids to text, a token at a time: [`Detok`] decodes incrementally
//! (holding back a character whose bytes are not all there yet), [`StopMatcher`] cuts the text
//! at the first stop string (holding back what could be the start of one).

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

/// Cuts generated text at the first of some stop strings (the stop string itself left out).
/// Text that could be the start of a stop string is held back until it is known not to be.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), held: String::new() }
    }

    /// The text safe to emit after `text` arrives, and whether a stop string was reached
    /// (then nothing after it is emitted).
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // The longest tail of the held text that is a proper prefix of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(i, _)| &s[..i]))
            .filter(|p| self.held.ends_with(p))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// What is held back, at the end of the generation.
    pub fn finish(self) -> String {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut m = StopMatcher::new(&["STOP".into(), "é!".into()]);
        assert_eq!(m.push("abc S"), ("abc ".into(), false));
        assert_eq!(m.push("T"), ("".into(), false));
        assert_eq!(m.push("x"), ("STx".into(), false));
        assert_eq!(m.push("é"), ("".into(), false));
        assert_eq!(m.push("é!tail"), ("é".into(), true));
        let mut m = StopMatcher::new(&["ab".into()]);
        assert_eq!(m.push("xa"), ("x".into(), false));
        assert_eq!(m.finish(), "a");
    }
}
