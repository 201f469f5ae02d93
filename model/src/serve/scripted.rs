//! A server whose engine is a test's script (the `scripted` feature: test builds only), on the
//! built-in model's tokenizer and chat template: each request goes to the script as a
//! [`Turn`], and the script sends the token ids the engine would, spelling an output the
//! random built-in model would never write (reasoning, tool calls). Everything else runs as in
//! production: the request's checks, its prompt, detokenizing, stop strings, the output
//! parser, the JSON body or the SSE chunks, and (served by [`super::router`]) the HTTP stack.

use std::sync::Arc;

use tokenizers::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use super::prompt::Chat;
use super::request::Limits;
use super::special::{Special, SpecialInContent};
use super::worker::{self, ModelInfo, Update};
use super::{Served, router};
use crate::engine::{Event, Finish, RequestParams};
use crate::structured::Structured;

/// One request as the script gets it.
pub struct Turn {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    /// The request's token channel, the engine thread's end of it.
    pub out: UnboundedSender<Update>,
    tokenizer: Arc<Tokenizer>,
    eos: u32,
}

impl Turn {
    /// Sends token `id` as the engine sends one (`finished` on the last).
    pub fn send(&self, id: u32, finished: Option<Finish>) {
        let event = Event { id: 0, token: id, finished, logprob: None, top_logprobs: vec![], cached: 0 };
        let _ = self.out.send(Update::Token(event));
    }

    /// Sends the token ids of `text`, then the eos id, which ends the turn.
    pub fn write(&self, text: &str) {
        for id in self.tokenizer.encode(text, false).expect("encoding the script").get_ids() {
            self.send(*id, None);
        }
        self.send(self.eos, Some(Finish::Stop));
    }

    /// The built-in model's tokenizer (the server's).
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The text of the last user message in the prompt (the built-in template's
    /// `<|im_start|>user\nTEXT<|im_end|>`), empty if there is none.
    pub fn last_user_message(&self) -> String {
        let prompt = self.tokenizer.decode(&self.prompt, false).expect("decoding the prompt");
        let last = prompt.rsplit_once("<|im_start|>user\n").map_or("", |(_, turn)| turn);
        last.split("<|im_end|>").next().unwrap_or_default().to_string()
    }
}

/// A server on the built-in model's tokenizer and chat template whose engine hands each
/// request to `script`, one at a time (2 slots, no queue past them, a context of 4096).
pub fn built_in(script: impl FnMut(Turn) + Send + 'static) -> Arc<Served> {
    built_in_with(SpecialInContent::Allow, script)
}

/// [`built_in`] with special-token text in chat content as `special` says.
pub fn built_in_with(special: SpecialInContent, script: impl FnMut(Turn) + Send + 'static) -> Arc<Served> {
    from_dir(&crate::built_in::dir().expect("writing the built-in model"), special, script)
}

/// [`built_in_with`] on the tokenizer, chat template and eos ids of the checkpoint files in
/// `dir` (a tokenizer fixture, say).
pub fn from_dir(
    dir: &std::path::Path,
    special: SpecialInContent,
    mut script: impl FnMut(Turn) + Send + 'static,
) -> Arc<Served> {
    let tokenizer = Arc::new(Tokenizer::from_file(dir.join("tokenizer.json")).expect("its tokenizer"));
    let chat = Chat::from_dir(dir).expect("its chat template");
    let eos = chat.stop_ids()[0];
    let info = ModelInfo { slots: 2, max_len: 4096, vocab: tokenizer.get_vocab_size(true) };
    let tok = tokenizer.clone();
    let engine = worker::scripted(info, 0, move |prompt, params, out| {
        script(Turn { prompt, params, out, tokenizer: tok.clone(), eos })
    });
    let special = Special::new(&tokenizer, special).expect("the tokenizer's special tokens");
    let (limits, ending, access, metrics) =
        (Limits::default(), Default::default(), Default::default(), Default::default());
    let name = "default".into();
    let structured = Structured::new(&tokenizer, info.vocab, &chat.stop_ids());
    Arc::new(Served { name, tokenizer, chat, engine, created: 0, limits, special, ending, access, metrics, structured })
}

/// The routes of a [`built_in`] server whose engine writes back each request's last user
/// message as the model's output: a client sends the text a model would write, and sees what
/// the server makes of it.
pub fn echo() -> axum::Router {
    router(built_in(|turn| turn.write(&turn.last_user_message())))
}
