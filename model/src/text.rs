//! Text in, text out: a checkpoint (or the built-in model) with its tokenizer and chat
//! template on the GPU or the CPU, behind one object ([`Llm`]), for a Rust program that wants
//! a completion or a chat reply and not the engine's token ids.
//!
//! ```no_run
//! use model::text::{Generation, Llm, LoadOptions};
//!
//! // None: the small built-in model (random weights); or a checkpoint directory, or a Hugging
//! // Face repo id such as "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16" in the local cache.
//! let mut llm = Llm::load(None, &LoadOptions::default())?;
//! let text = llm.complete("The capital of France is", &Generation::default())?;
//! let reply = llm.chat(&serde_json::json!([{"role": "user", "content": "Hello!"}]), &Generation::default())?;
//! println!("{text}\n{:?}", reply.content);
//! # Ok::<(), model::Error>(())
//! ```
//!
//! One request at a time (one slot): for many clients at once, `serve` batches them. Each call
//! prefills its whole prompt (a chat renders the whole conversation again).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Map, Value as Json};
use tokenizers::Tokenizer;

use crate::chat::{ChatTemplate, Delta, Detok, Message, OutputParser, ParserOptions};
use crate::cpu::Cpu;
use crate::cuda::Cuda;
use crate::engine::{Engine, Event, Finish, RequestParams};
use crate::model::Model;
use crate::prefix::{DEFAULT_BUDGET, PrefixSettings};
use crate::sampling::SamplingParams;
use crate::{Error, Result};

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The GPU when one can be opened, else the CPU reference backend (logged).
    #[default]
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (an error without a GPU).
    Cuda,
}

/// How [`Llm::load`] loads.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadOptions {
    pub device: Device,
    /// The tokens a request may hold (its prompt plus what it generates).
    pub max_len: usize,
    /// Feed at most this many prompt tokens a step (long prompts in chunks); `None`: unbounded.
    pub max_step_tokens: Option<usize>,
    /// The prefix cache ([`crate::prefix`]): a chat's turns restore the state after the last
    /// turn instead of prefilling the whole conversation again (a budget of 0: off; without a
    /// `turn_start`, the tokenizer's `<|im_start|>` where it has one).
    pub prefix_cache: PrefixSettings,
}

impl Default for LoadOptions {
    fn default() -> LoadOptions {
        LoadOptions {
            device: Device::Auto,
            max_len: 4096,
            max_step_tokens: None,
            prefix_cache: PrefixSettings::bytes(DEFAULT_BUDGET),
        }
    }
}

/// How one request generates.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// Tokens to generate at most (it also ends at the checkpoint's end-of-sequence ids).
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Chat only: `enable_thinking` for the chat template (false: no `<think>` block).
    pub thinking: bool,
}

impl Default for Generation {
    fn default() -> Generation {
        Generation { max_new_tokens: 256, sampling: SamplingParams::greedy(), thinking: true }
    }
}

/// A generated token, its log-probability and the most likely tokens' (id, log-probability).
pub type TokenLogprobs = (u32, f32, Vec<(u32, f32)>);

/// What one request gave, beside its text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Output {
    pub prompt_tokens: usize,
    /// Prompt tokens restored from the prefix cache (not computed).
    pub cached_tokens: usize,
    pub tokens: Vec<u32>,
    /// Each generated token's log-probability and the most likely tokens', when asked for.
    pub logprobs: Vec<TokenLogprobs>,
    /// Why it ended (`None`: it did not, as after an error).
    pub finish: Option<Finish>,
    /// Seconds of the steps before the first token, of the first decode step (on a GPU it
    /// records the step's graph), and of the others.
    pub prefill_s: f64,
    pub first_s: f64,
    pub decode_s: f64,
}

impl Output {
    /// The speeds, as one line.
    pub fn speeds(&self) -> String {
        let decoded = self.tokens.len().saturating_sub(1);
        let timed = decoded.saturating_sub(1);
        format!(
            "prefill: {} tokens in {:.1} ms ({:.0} tokens/s; {} restored from the prefix cache); decode: {decoded} tokens, {:.2} ms/token after the first step ({:.1} ms: on a GPU it records the step's graph)",
            self.prompt_tokens,
            self.prefill_s * 1e3,
            self.prompt_tokens as f64 / self.prefill_s.max(1e-9),
            self.cached_tokens,
            if timed > 0 { self.decode_s * 1e3 / timed as f64 } else { 0.0 },
            self.first_s * 1e3
        )
    }
}

/// The engine over either backend.
enum Engines {
    Cpu(Box<Engine<Cpu>>),
    Cuda(Box<Engine<Cuda>>),
}

impl Engines {
    fn add(&mut self, prompt: &[u32], params: RequestParams) -> Result<u64> {
        match self {
            Engines::Cpu(e) => e.add(prompt, params),
            Engines::Cuda(e) => e.add(prompt, params),
        }
    }

    fn step(&mut self) -> Result<Vec<Event>> {
        match self {
            Engines::Cpu(e) => e.step(),
            Engines::Cuda(e) => e.step(),
        }
    }

    fn cancel(&mut self, id: u64) -> Result<()> {
        match self {
            Engines::Cpu(e) => e.cancel(id),
            Engines::Cuda(e) => e.cancel(id),
        }
    }

    fn has_work(&self) -> bool {
        match self {
            Engines::Cpu(e) => e.has_work(),
            Engines::Cuda(e) => e.has_work(),
        }
    }
}

/// A model with its tokenizer and chat template, one request at a time.
pub struct Llm {
    engine: Engines,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    /// The ids that end a request.
    eos: Vec<u32>,
    dir: PathBuf,
    backend: String,
}

impl Llm {
    /// The checkpoint `model` names (a directory, or a Hugging Face repo id in the local cache,
    /// as [`crate::hub::resolve`] finds it; `None`: the built-in model).
    pub fn load(model: Option<&str>, opts: &LoadOptions) -> Result<Llm> {
        Llm::load_with_progress(model, opts, &mut |_, _| {})
    }

    /// [`Llm::load`], calling `progress(layers_done, layers)` after each layer's weights.
    pub fn load_with_progress(
        model: Option<&str>,
        opts: &LoadOptions,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Llm> {
        let t0 = Instant::now();
        let dir = crate::hub::resolve(model).map_err(Error::Locate)?.dir;
        tracing::info!("loading {}", dir.display());
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Err(Error::Tokenizer(format!("{} has no tokenizer.json", dir.display())));
        }
        let tokenizer =
            Tokenizer::from_file(&tok_path).map_err(|e| Error::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let template = ChatTemplate::from_dir(&dir)?;
        let eos = crate::chat::generation_eos_ids(&dir).map_err(Error::Tokenizer)?;
        let gpu = match opts.device {
            Device::Cpu => None,
            Device::Cuda => Some(Cuda::new(0)?),
            Device::Auto => {
                Cuda::new(0).map_err(|e| tracing::info!("no GPU ({e}): using the CPU reference backend")).ok()
            }
        };
        let max_len = opts.max_len;
        let (engine, backend) = match gpu {
            Some(cuda) => {
                let name = format!("CUDA ({})", cuda.gpu().name().unwrap_or_default());
                let model = Model::from_dir(cuda, &dir, 1, max_len, progress)?;
                (Engines::Cuda(Box::new(Engine::new(model))), name)
            }
            None => {
                let model = Model::from_dir(Cpu::default(), &dir, 1, max_len, progress)?;
                (Engines::Cpu(Box::new(Engine::new(model))), "CPU reference".to_string())
            }
        };
        let tokenizer = Arc::new(tokenizer);
        let mut llm = Llm { engine, tokenizer, template, eos, dir, backend };
        if let Some(n) = opts.max_step_tokens {
            match &mut llm.engine {
                Engines::Cpu(e) => e.set_max_step_tokens(n)?,
                Engines::Cuda(e) => e.set_max_step_tokens(n)?,
            }
        }
        let prefix = PrefixSettings {
            turn_start: opts.prefix_cache.turn_start.or_else(|| crate::chat::turn_start(&llm.tokenizer)),
            ..opts.prefix_cache
        };
        match &mut llm.engine {
            Engines::Cpu(e) => e.set_prefix_cache(prefix),
            Engines::Cuda(e) => e.set_prefix_cache(prefix),
        }
        tracing::info!("loaded in {:.2} s, backend: {}", t0.elapsed().as_secs_f64(), llm.backend);
        Ok(llm)
    }

    /// The checkpoint directory it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Which backend runs it ("CUDA (the GPU's name)" or "CPU reference").
    pub fn backend(&self) -> &str {
        &self.backend
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The chat template, when the checkpoint has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_ref()
    }

    /// `text`'s token ids (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.tokenizer.encode(text, false).map_err(|e| Error::Tokenizer(format!("encoding: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text that continues `prompt`.
    pub fn complete(&mut self, prompt: &str, how: &Generation) -> Result<String> {
        let ids = self.encode(prompt)?;
        let mut text = String::new();
        self.generate(&ids, how, &mut |chunk| {
            text.push_str(chunk);
            Ok(())
        })?;
        Ok(text)
    }

    /// The assistant's reply to `messages` (OpenAI-style: an array of `{"role", "content"}`),
    /// its reasoning split out.
    pub fn chat(&mut self, messages: &Json, how: &Generation) -> Result<Message> {
        let mut deltas = Vec::new();
        self.chat_stream(messages, how, &mut |d| {
            deltas.push(d);
            Ok(())
        })?;
        Ok(Message::from_deltas(deltas))
    }

    /// [`Llm::chat`], giving `out` the reply's pieces as they come.
    pub fn chat_stream(
        &mut self,
        messages: &Json,
        how: &Generation,
        out: &mut dyn FnMut(Delta) -> std::io::Result<()>,
    ) -> Result<Output> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| Error::Template(format!("{} has no chat template", self.dir.display())))?;
        let mut kwargs = Map::new();
        if !how.thinking {
            kwargs.insert("enable_thinking".into(), Json::Bool(false));
        }
        let text = template.render(messages, None, true, &kwargs)?;
        let ids = self.encode(&text)?;
        let starts_in_reasoning = crate::chat::prompt_opens_reasoning(&text);
        let mut parser = OutputParser::new(ParserOptions { reasoning: true, starts_in_reasoning, tools: None });
        let output = self.generate(&ids, how, &mut |chunk| parser.push(chunk).into_iter().try_for_each(&mut *out))?;
        parser.finish().into_iter().try_for_each(out)?;
        Ok(output)
    }

    /// Runs one request from `prompt`'s ids to its end, giving `out` the generated text as a
    /// [`Detok`] lets it through (a character split over tokens once whole, special tokens but
    /// the parser's tags skipped; the prompt's text not included). A request left without a token (its logits NaN, or all
    /// `-inf`) is an error.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        how: &Generation,
        out: &mut dyn FnMut(&str) -> std::io::Result<()>,
    ) -> Result<Output> {
        let params = RequestParams {
            max_new_tokens: how.max_new_tokens,
            sampling: how.sampling,
            stop_tokens: self.eos.clone(),
            min_new_tokens: 0,
        };
        let id = self.engine.add(prompt, params)?;
        let result = self.run(prompt, out);
        if result.is_err() && self.engine.has_work() {
            // Ended here (the output refused, say): the next request starts with an idle engine.
            self.engine.cancel(id)?;
        }
        result
    }

    /// [`Llm::generate`]'s request, once added.
    fn run(&mut self, prompt: &[u32], out: &mut dyn FnMut(&str) -> std::io::Result<()>) -> Result<Output> {
        let mut detok = Detok::new(self.tokenizer.clone(), prompt);
        let mut output = Output { prompt_tokens: prompt.len(), ..Output::default() };
        while self.engine.has_work() {
            let t = Instant::now();
            let events = self.engine.step()?;
            let dt = t.elapsed().as_secs_f64();
            // A prompt fed in chunks takes several steps before its first token.
            match output.tokens.len() {
                0 => output.prefill_s += dt,
                1 => output.first_s = dt,
                _ => output.decode_s += dt,
            }
            for e in events {
                output.finish = e.finished;
                if let Some(Finish::Failed(why)) = e.finished {
                    return Err(Error::NoToken(format!("after {} tokens: {why}", output.tokens.len())));
                }
                output.tokens.push(e.token);
                output.cached_tokens = e.cached;
                output.logprobs.extend(e.logprob.map(|l| (e.token, l, e.top_logprobs)));
                let piece = detok.push(e.token).map_err(Error::Tokenizer)?;
                if !piece.is_empty() {
                    out(&piece)?;
                }
            }
        }
        // What the detokenizer still holds (bytes of a character never completed), lossily.
        let rest = detok.finish().map_err(Error::Tokenizer)?;
        if !rest.is_empty() {
            out(&rest)?;
        }
        Ok(output)
    }
}
