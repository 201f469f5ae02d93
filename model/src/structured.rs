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

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value as Json, json};
use tokenizers::Tokenizer;

use crate::chat::TokenBytes;
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
    /// For `tokenizer` over a vocabulary of `vocab` ids (ids past the tokenizer's never
    /// allowed), `eos` the ids that end an output (at least one).
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Structured, String> {
        let env: TokEnv = Arc::new(Vocabulary::new(tokenizer, vocab, eos)?);
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

/// The vocabulary as llguidance reads it: each token's bytes in a trie (a special token's
/// name behind [`TokTrie::SPECIAL_TOKEN_MARKER`], so that no text spells it), text tokenized by
/// the tokenizer itself. (What toktrie_hf_tokenizers builds, without its copy of the tokenizer
/// through an older tokenizers, whose added tokens take time quadratic in their number: 50 s for
/// the 131072 ids of `serve --synthetic`.)
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl Vocabulary {
    fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Vocabulary, String> {
        let err = |what: String| format!("the tokenizer for structured outputs: {what}");
        let have = tokenizer.get_vocab_size(true);
        if have > vocab {
            return Err(err(format!("{have} tokens, more than the model's {vocab}")));
        }
        let Some(&first) = eos.first() else { return Err(err("no end-of-sequence token".into())) };
        if let Some(bad) = eos.iter().find(|&&id| id as usize >= vocab) {
            return Err(err(format!("end-of-sequence token {bad} past the vocabulary of {vocab}")));
        }
        // A tokenizer that prepends a space to what it encodes would tokenize the pieces of
        // an output unlike the output.
        let prepends = |part: Option<Json>| part.is_some_and(|v| prepends_space(&v));
        if prepends(tokenizer.get_normalizer().and_then(|n| serde_json::to_value(n).ok()))
            || prepends(tokenizer.get_pre_tokenizer().and_then(|p| serde_json::to_value(p).ok()))
        {
            return Err(err("it prepends a space to every text it encodes (Prepend or Metaspace)".into()));
        }
        let bytes = TokenBytes::new(tokenizer);
        let special = |name: &str| [&[TokTrie::SPECIAL_TOKEN_MARKER], name.as_bytes()].concat();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match bytes.added(id) {
                // As llguidance's own loader: added tokens of the form <...> are special too.
                Some(t) if t.special || (t.content.starts_with('<') && t.content.ends_with('>')) => special(&t.content),
                _ if (id as usize) < have => bytes.of(id),
                _ => special(&format!("<[{id}]>")),
            })
            .collect();
        let mut trie = TokTrie::from(&TokRxInfo::new(vocab as u32, first), &words);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        Ok(Vocabulary { trie, tokenizer: tokenizer.clone() })
    }

    fn encode(&self, text: &str) -> Vec<TokenId> {
        self.tokenizer.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default()
    }
}

/// Whether a tokenizer part (as JSON) prepends a space: a `Prepend` normalizer, or a
/// `Metaspace` pre-tokenizer whose prepend scheme is not `never`, anywhere in a sequence.
fn prepends_space(part: &Json) -> bool {
    match part {
        Json::Object(o) => {
            let kind = o.get("type").and_then(Json::as_str);
            kind == Some("Prepend")
                || (kind == Some("Metaspace") && o.get("prepend_scheme").and_then(Json::as_str) != Some("never"))
                || o.values().any(prepends_space)
        }
        Json::Array(a) => a.iter().any(prepends_space),
        _ => false,
    }
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.encode(s))
    }

    fn tokenize_bytes_special(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.trie.tokenize_with_special(s, |s| self.encode(s)))
    }
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

    /// The tokens `format` allows first, over `vocab` ids.
    fn first_allowed(s: &Structured, format: &Format, vocab: usize) -> Vec<u32> {
        let mut c = s.constraint(format, false).unwrap();
        let mut mask = vec![u32::MAX; host::sample::mask_words(vocab)];
        c.restrict(&mut mask).unwrap();
        (0..vocab as u32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect()
    }

    /// The vocabulary as llguidance reads it: the built-in (byte-level) tokenizer stretched
    /// with added words as `serve --synthetic` stretches it, then ids past the tokenizer's. A
    /// regex of any text allows each byte that may start a UTF-8 character but NUL, each added
    /// word (its own bytes) and the eos; never another special token (ChatML's markers, and as
    /// llguidance's own loader, added tokens of the form <...>) nor an id past the tokenizer's.
    #[test]
    fn every_token_is_its_own_bytes_and_specials_are_never_text() {
        let dir = crate::built_in::dir().unwrap();
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        crate::synthetic::fill_vocabulary(&mut tokenizer, 300);
        let (vocab, eos) = (320, tokenizer.token_to_id("<|im_end|>").unwrap());
        let s = Structured::new(&tokenizer, vocab, &[eos]).unwrap();
        let allowed = first_allowed(&s, &Format::Regex("[^\\x00]*".into()), vocab);
        let added = tokenizer.get_added_tokens_decoder();
        let special = |id: u32| added.get(&id).is_some_and(|t| t.special || t.content.starts_with('<'));
        let starts_a_character = |b: u32| (1..0x80).contains(&b) || (0xc2..=0xf4).contains(&b);
        let expected: Vec<u32> =
            (0..300).filter(|&id| id == eos || if id < 256 { starts_a_character(id) } else { !special(id) }).collect();
        assert_eq!(
            allowed, expected,
            "UTF-8 leads but NUL, every added word, the eos; no other special, nothing past 300"
        );
        assert_eq!((256..300).filter(|&id| special(id)).count(), 10, "the built-in tokenizer's markers and tags");
        let w = tokenizer.token_to_id("w299 ").unwrap();
        let word = first_allowed(&s, &Format::Choice(vec!["w299 ".into()]), vocab);
        assert_eq!(word, [w], "a fixed text forced as the tokenizer encodes it: the word's own token");
    }

    /// A tokenizer that prepends a space to what it encodes is refused by name, as are eos ids
    /// past the vocabulary, none at all, and a vocabulary smaller than the tokenizer's.
    #[test]
    fn unusable_tokenizers_are_refused() {
        let dir = crate::built_in::dir().unwrap();
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let have = tokenizer.get_vocab_size(true);
        let err = |t: &Tokenizer, vocab: usize, eos: &[u32]| Structured::new(t, vocab, eos).err().unwrap_or_default();
        assert!(err(&tokenizer, have, &[have as u32]).contains("past the vocabulary"));
        assert!(err(&tokenizer, have, &[]).contains("no end-of-sequence token"));
        assert!(err(&tokenizer, have - 1, &[0]).contains("more than the model's"));
        let mut json: Json = serde_json::from_str(&tokenizer.to_string(false).unwrap()).unwrap();
        json["normalizer"] = json!({"type": "Prepend", "prepend": "\u{2581}"});
        let prepending = Tokenizer::from_bytes(json.to_string().as_bytes()).unwrap();
        assert!(err(&prepending, have, &[0]).contains("prepends a space"));
        assert!(Structured::new(&tokenizer, have, &[0]).is_ok());
    }
}
