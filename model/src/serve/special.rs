//! Special-token text inside chat content (`serve --special-tokens-in-content`). The chat
//! template writes a conversation as one text whose control tokens (`<|im_start|>`,
//! `<|im_end|>`, ...) are the special added tokens of the tokenizer, so content that holds
//! their text would tokenize to control tokens too: a user could close their turn and open a
//! system one. [`SpecialInContent`] says what happens to such text: kept as control tokens
//! (`allow`, as vLLM and transformers' `apply_chat_template` do), the request refused
//! (`refuse`), or tokenized as the plain text it is (`escape`).
//!
//! To escape, the conversation is rendered with each piece of content that holds special-token
//! text replaced by a marker; the template's text around the markers is tokenized as usual and
//! each piece with special-token matching off. A template that changes such a piece (trims
//! it, splits it) is rendered around the piece as it was given. What is looked at is the
//! messages' content (strings and text parts), not the arguments of tool calls.

use aho_corasick::{AhoCorasick, MatchKind};
use serde_json::{Map, Value};
use tokenizers::Tokenizer;

use super::api::ApiError;
use super::prompt::Chat;

/// What `serve` does with special-token text in chat content.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecialInContent {
    /// Tokenized as the control tokens it spells (vLLM's and transformers' behaviour).
    #[default]
    Allow,
    /// The request is refused with 400, naming the message.
    Refuse,
    /// Tokenized as plain text: it can never become a control token.
    Escape,
}

/// The policy and what it needs of the tokenizer.
pub struct Special {
    pub policy: SpecialInContent,
    /// The text of each special added token.
    texts: Vec<String>,
    /// Finds them (the longest at a place), in time linear in the text.
    finder: AhoCorasick,
    /// The tokenizer with special-token matching off (only for `escape`).
    plain: Option<Tokenizer>,
}

/// A rendered chat prompt: its text and its tokens.
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Special {
    pub fn new(tokenizer: &Tokenizer, policy: SpecialInContent) -> Result<Special, String> {
        let mut texts: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.content.is_empty())
            .map(|t| t.content)
            .collect();
        texts.sort();
        texts.dedup();
        let finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&texts)
            .map_err(|e| format!("finding the tokenizer's {} special tokens: {e}", texts.len()))?;
        let plain = (policy == SpecialInContent::Escape).then(|| {
            let mut t = tokenizer.clone();
            t.set_encode_special_tokens(true);
            t
        });
        Ok(Special { policy, texts, finder, plain })
    }

    /// The first special token's text in `s`, if any.
    fn first_in(&self, s: &str) -> Option<&str> {
        self.finder.find(s).map(|m| self.texts[m.pattern().as_usize()].as_str())
    }

    /// `messages` rendered by `chat` (with `tools` and `kwargs`) and tokenized by `tokenizer`,
    /// special-token text in their content as the policy says.
    pub fn prompt(
        &self,
        (chat, tokenizer): (&Chat, &Tokenizer),
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &Map<String, Value>,
    ) -> Result<Prompt, ApiError> {
        let render = |m: &Value| {
            chat.render(m, tools, kwargs)
                .map_err(|e| ApiError::invalid(Some("messages"), format!("The chat template failed: {e}")))
        };
        // The content pieces that hold special-token text: (message, part or None, text).
        let mut pieces = Vec::new();
        for (i, m) in messages.as_array().into_iter().flatten().enumerate() {
            match &m["content"] {
                Value::String(s) => pieces.push((i, None, s.as_str())),
                Value::Array(parts) => {
                    let texts = parts.iter().enumerate().filter_map(|(j, p)| Some((i, Some(j), p["text"].as_str()?)));
                    pieces.extend(texts);
                }
                _ => {}
            }
        }
        pieces.retain(|&(.., text)| self.first_in(text).is_some());
        let plain = match (&self.plain, self.policy, pieces.first()) {
            (_, SpecialInContent::Allow, _) | (_, _, None) => {
                let text = render(messages)?;
                return Ok(Prompt { ids: encode(tokenizer, &text)?, text });
            }
            (_, SpecialInContent::Refuse, Some(&(i, _, text))) => {
                let token = self.first_in(text).unwrap_or_default();
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].content")),
                    format!(
                        "The content holds the special token `{token}`; this server refuses special-token text in \
                         chat content (--special-tokens-in-content refuse)"
                    ),
                ));
            }
            (Some(plain), ..) => plain,
            (None, ..) => return Err(ApiError::internal("escaping special tokens without a plain tokenizer")),
        };
        // Each piece replaced by a marker no client can guess, then the text around the markers
        // tokenized as usual and each piece as plain text.
        let nonce = super::fresh();
        let marker = |n: usize| format!("\u{F8FF}{nonce:016x}.{n}\u{F8FE}");
        let mut marked = messages.clone();
        for (n, &(i, j, _)) in pieces.iter().enumerate() {
            let slot = match j {
                None => &mut marked[i]["content"],
                Some(j) => &mut marked[i]["content"][j]["text"],
            };
            *slot = Value::String(marker(n));
        }
        let template = render(&marked)?;
        let (mut text, mut ids, mut rest) = (String::new(), Vec::new(), template.as_str());
        for (n, &(i, _, piece)) in pieces.iter().enumerate() {
            let Some((before, after)) = rest.split_once(&marker(n)) else {
                return Err(ApiError::invalid(
                    Some(&format!("messages[{i}].content")),
                    "The chat template does not write this content as given, so its special-token text cannot be \
                     escaped; remove it, or serve with --special-tokens-in-content allow",
                ));
            };
            ids.extend(encode(tokenizer, before)?);
            ids.extend(encode(plain, piece)?);
            text.push_str(before);
            text.push_str(piece);
            rest = after;
        }
        ids.extend(encode(tokenizer, rest)?);
        text.push_str(rest);
        Ok(Prompt { text, ids })
    }
}

/// `text`'s token ids.
pub fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, ApiError> {
    let enc = tokenizer.encode(text, false).map_err(|e| ApiError::internal(format!("tokenizing: {e}")))?;
    Ok(enc.get_ids().to_vec())
}
