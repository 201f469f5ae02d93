//! Structured outputs: a request's output held to a JSON schema, a regular expression, one of a
//! few strings or a Lark grammar, through llguidance (the library vLLM, SGLang and llama.cpp
//! use). Before each of the request's tokens, the tokens that keep its output valid become
//! the sampler's mask ([`Constraint`]), so constrained rows batch with free ones; the request
//! ends once the output is complete.
//!
//! JSON is written compact (no whitespace between tokens of the JSON, llguidance's
//! `whitespace_flexible: false`, unless the schema's own `x-guidance` says otherwise), so a
//! model cannot pad an answer with whitespace forever. Where the prompt opened a reasoning
//! block (a thinking chat template), the constraint starts after the token that ends it
//! (`</think>`), as vLLM does: the reasoning itself is free.

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value as Json, json};
use tokenizers::Tokenizer;

use crate::engine::Constraint;

/// What a request's output must be.
#[derive(Clone, Debug, PartialEq)]
pub enum Format {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Json),
    /// Text the regular expression matches whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// Text of this Lark grammar (llguidance's dialect).
    Lark(String),
}

/// The tokenizer as llguidance sees it, made once for a model (the vocabulary's byte trie).
pub struct Structured {
    factory: ParserFactory,
    vocab: usize,
    /// The token that ends a reasoning block, when the tokenizer has it as one token.
    think_end: Option<u32>,
}

impl Structured {
    /// For `tokenizer` (llguidance reads its own copy, from its JSON) over a vocabulary of
    /// `vocab` ids, `eos` the ids that end an output.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Structured, String> {
        let json = tokenizer.to_string(false).map_err(|e| format!("the tokenizer for structured outputs: {e}"))?;
        let mut bytes = toktrie_hf_tokenizers::ByteTokenizer::from_json_bytes(json.as_bytes())
            .map_err(|e| format!("the tokenizer for structured outputs: {e}"))?;
        if !eos.is_empty() {
            bytes.set_eos_tokens(eos);
        }
        let env = bytes.into_tok_env(Some(vocab)).map_err(|e| format!("the tokenizer for structured outputs: {e}"))?;
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| format!("the structured-output parser factory: {e}"))?;
        factory.quiet();
        Ok(Structured { factory, vocab, think_end: tokenizer.token_to_id("</think>") })
    }

    /// The constraint of `format` for one request (an error names what does not compile);
    /// `after_reasoning`: it starts once the reasoning block the prompt opened has ended.
    pub fn constraint(&self, format: &Format, after_reasoning: bool) -> Result<Box<dyn Constraint>, String> {
        let parser = self.factory.create_parser(grammar(format)).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        let waiting = if after_reasoning { self.think_end } else { None };
        Ok(Box::new(Guided { matcher, waiting, vocab: self.vocab }))
    }
}

/// llguidance's grammar for `format`.
fn grammar(format: &Format) -> TopLevelGrammar {
    let compact = |mut schema: Json| {
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
        }
        TopLevelGrammar::from_json_schema(schema)
    };
    match format {
        Format::JsonObject => compact(json!({"type": "object"})),
        Format::JsonSchema(schema) => compact(schema.clone()),
        Format::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Format::Choice(choices) => {
            TopLevelGrammar::from_regex(&choices.iter().map(|c| escape(c)).collect::<Vec<_>>().join("|"))
        }
        Format::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
    }
}

/// `s` as a regular expression that matches it literally.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if r"\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// One request's llguidance matcher.
struct Guided {
    matcher: Matcher,
    /// The token the constraint waits for (the end of the reasoning), until it comes.
    waiting: Option<u32>,
    vocab: usize,
}

impl Constraint for Guided {
    fn restrict(&mut self, mask: &mut [u32]) -> Result<(), String> {
        if self.waiting.is_some() {
            return Ok(());
        }
        // Once the output is complete: the eos tokens only.
        let allowed = self.matcher.compute_mask_or_eos().map_err(|e| e.to_string())?;
        let words = allowed.as_slice();
        for (i, m) in mask.iter_mut().enumerate() {
            *m &= words.get(i).copied().unwrap_or(0);
        }
        // Bits past the vocabulary stay clear (the last word's tail).
        if let Some(last) = mask.last_mut().filter(|_| !self.vocab.is_multiple_of(32)) {
            *last &= (1u32 << (self.vocab % 32)) - 1;
        }
        Ok(())
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        match self.waiting {
            Some(end) if end == token => self.waiting = None,
            Some(_) => {}
            None => self.matcher.consume_token(token).map_err(|e| e.to_string())?,
        }
        Ok(())
    }

    fn complete(&self) -> bool {
        self.waiting.is_none() && self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_escaped_literally() {
        assert_eq!(escape("a.b|c"), r"a\.b\|c");
        assert_eq!(escape("(x)*[y]{2}^$"), r"\(x\)\*\[y\]\{2\}\^\$");
        assert_eq!(escape("plain words"), "plain words");
    }
}
