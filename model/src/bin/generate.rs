//! `generate`: generates text with a NemotronH checkpoint (a directory with config.json,
//! safetensors and tokenizer.json, or a Hugging Face repo id already in the local cache, found
//! by [`model::hub`] as `serve` finds it), streaming the text as it comes (the tokenizer's
//! decode stream: each token decoded against the few before it, a character split over tokens
//! printed once complete), then logs prefill and decode speed. Without `--model` it runs the small built-in model
//! (random weights: the text means nothing). The default backend, `auto`, is the GPU when one
//! can be opened and the CPU reference otherwise (it says which and why); `cuda` insists on
//! the GPU. `generate --help` lists the options.
//!
//! The generated text goes to stdout; logs go to stderr through tracing (`RUST_LOG`, `info`
//! by default), with a progress bar over the layers while the weights load when stderr is a
//! terminal.
//!
//! Sampling (model::sampling): temperature 0 (the default) is greedy; otherwise top-k, top-p
//! and min-p truncate, the repetition / presence / frequency penalties apply to the tokens
//! generated so far, and the seed fixes the draws. Bad values are refused before the model
//! loads, naming the parameter. `--logprobs` prints each generated token's log-probability
//! (under the penalized logits at temperature 1) and their mean on stderr at the end;
//! `--top-logprobs N` (at most 20) also the N most likely tokens' at each step. A
//! request left without a token (its logits NaN, or all `-inf`) is an error: exit status 1.
//!
//! `--chat`: a chat on stdin/stdout through the checkpoint's chat template
//! ([`model::chat::ChatTemplate`]), one user message a line, the conversation kept (each turn
//! renders it whole and prefills it again: the engine keeps no state between requests), a
//! turn ending at the eos ids ([`model::chat::generation_eos_ids`]) or `--max-new-tokens`. The
//! reasoning (the `<think>` block) is printed dimmed on a terminal, between `[think]` and
//! `[/think]` otherwise. EOF or `/exit` ends it; with `--prompt` it is one turn with that
//! message, then exit.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use model::backend::Backend;
use model::chat::{ChatTemplate, Delta, OutputParser, ParserOptions};
use model::config::Config;
use model::cpu::Cpu;
use model::cuda::Cuda;
use model::engine::{Engine, Finish, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;
use model::weights::Checkpoint;
use serde_json::{Map, Value as Json, json};
use tokenizers::Tokenizer;

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Choice {
    /// The GPU when one can be opened, else the CPU reference backend.
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (an error without a GPU).
    Cuda,
}

/// Generates text with a NemotronH model, streaming it to stdout (logs on stderr; RUST_LOG
/// sets their level).
#[derive(Parser, Debug)]
#[command(name = "generate", version, allow_negative_numbers = true)]
struct Args {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a Hugging Face
    /// repo id ORG/NAME[@REVISION] already in the local cache ($HF_HUB_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub; nothing is downloaded); without it, the built-in model (random
    /// weights: the text means nothing).
    #[arg(long)]
    model: Option<String>,
    /// The text to continue; with --chat, the one user message of a one-turn chat.
    #[arg(long)]
    prompt: Option<String>,
    /// Chat through the checkpoint's chat template: a user message per line of stdin, EOF or
    /// `/exit` ends it (with --prompt: one turn, then exit).
    #[arg(long)]
    chat: bool,
    /// With --chat: pass enable_thinking=false to the chat template (no <think> block).
    #[arg(long, requires = "chat")]
    no_thinking: bool,
    /// With --chat: the context the conversation may fill (its prompt plus a reply), in tokens.
    #[arg(long, default_value_t = 4096)]
    max_len: usize,
    /// Tokens to generate at most (per turn with --chat).
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the K most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches P.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only tokens at least P times as likely as the most likely one.
    #[arg(long)]
    min_p: Option<f32>,
    /// Divides a generated token's positive logits, multiplies its negative ones (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Subtracted from the logit of every token generated before (0: off).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Subtracted once per earlier occurrence among the generated tokens (0: off).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Seed of the sampler's draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print each generated token's log-probability, and their mean, on stderr at the end.
    #[arg(long)]
    logprobs: bool,
    /// Also print the N most likely tokens' log-probabilities at each step (at most 20).
    #[arg(long, default_value_t = 0)]
    top_logprobs: usize,
    /// Which backend runs the model.
    #[arg(long, value_enum, default_value_t = Choice::Auto)]
    backend: Choice,
    /// Feed at most this many tokens per engine step (long prompts in chunks); unbounded by default.
    #[arg(long)]
    max_step_tokens: Option<usize>,
}

impl Args {
    fn sampling(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed: self.seed,
            logprobs: self.logprobs,
            top_logprobs: self.top_logprobs,
        }
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    model::logs::init();
    if args.prompt.is_none() && !args.chat {
        // A usage error as clap reports its own (with the usage line; exit status 2).
        Args::command()
            .error(ErrorKind::MissingRequiredArgument, "--prompt is required (or --chat, for a chat on stdin)")
            .exit();
    }
    // Refused here, before the model loads (the engine would refuse the request anyway).
    args.sampling().check()?;
    let dir = model::hub::resolve(args.model.as_deref()).map_err(anyhow::Error::msg)?.dir;
    let t0 = Instant::now();
    tracing::info!("loading {}", dir.display());
    let config = Config::from_dir(&dir)?;
    if let Some(note) = config.kv_cache_note() {
        tracing::warn!("{note}");
    }
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        bail!("{} has no tokenizer.json: the CLI needs the checkpoint's tokenizer", dir.display());
    }
    let tokenizer =
        Tokenizer::from_file(&tok_path).map_err(|e| anyhow::anyhow!("reading {}: {e}", tok_path.display()))?;
    let template = match args.chat {
        false => None,
        true => Some(
            ChatTemplate::from_dir(&dir)?
                .with_context(|| format!("{} has no chat template: --chat needs one", dir.display()))?,
        ),
    };
    let ck = Checkpoint::open(&dir)?;
    tracing::info!("{} tensors, {:.1} MB mapped", ck.names().count(), ck.total_bytes() as f64 / 1e6);
    let layout = Layout::new(&config, &ck)?;
    let (prompt, max_len) = match (&template, &args.prompt) {
        (None, Some(text)) => {
            let prompt = encode(&tokenizer, text)?;
            let max_len = prompt.len().checked_add(args.max_new_tokens).with_context(|| {
                format!("a prompt of {} tokens plus --max-new-tokens {} overflows", prompt.len(), args.max_new_tokens)
            })?;
            (prompt, max_len)
        }
        _ => (Vec::new(), args.max_len),
    };
    let gpu = match args.backend {
        Choice::Cpu => None,
        Choice::Cuda => Some(Cuda::new(0)?),
        Choice::Auto => Cuda::new(0).map_err(|e| tracing::info!("no GPU ({e}): using the CPU reference backend")).ok(),
    };
    let eos = model::chat::generation_eos_ids(&dir).map_err(anyhow::Error::msg)?;
    let session = Session { args: &args, tokenizer: &tokenizer, eos };
    match gpu {
        Some(cuda) => {
            tracing::info!("backend: CUDA ({})", cuda.gpu().name().unwrap_or_default());
            session.run(load(cuda, &args, &config, &layout, max_len, t0)?, template.as_ref(), &prompt)
        }
        None => {
            tracing::info!("backend: CPU reference");
            session.run(load(Cpu::default(), &args, &config, &layout, max_len, t0)?, template.as_ref(), &prompt)
        }
    }
}

/// `text`'s token ids (no special tokens added).
fn encode(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?.get_ids().to_vec())
}

/// The engine over `backend` with the model loaded (one slot of `max_len` tokens), a
/// progress bar over the layers on stderr meanwhile (drawn only on a terminal).
fn load<B: Backend>(
    backend: B,
    args: &Args,
    config: &Config,
    layout: &Layout,
    max_len: usize,
    t0: Instant,
) -> Result<Engine<B>> {
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("  loading layers {bar:40} {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let model = Model::load_with_progress(backend, config, layout, 1, max_len, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let model = model?;
    tracing::info!("loaded in {:.2} s", t0.elapsed().as_secs_f64());
    let mut engine = Engine::new(model);
    if let Some(n) = args.max_step_tokens {
        engine.set_max_step_tokens(n)?;
    }
    Ok(engine)
}

/// What every turn needs.
struct Session<'a> {
    args: &'a Args,
    tokenizer: &'a Tokenizer,
    /// The ids that end a turn.
    eos: Vec<u32>,
}

/// What one request gave.
struct Turn {
    generated: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    /// Why the request was left without a token, if it was.
    failed: Option<String>,
    /// Seconds of the steps before the first token, of the first decode step, of the others.
    prefill_s: f64,
    first_s: f64,
    decode_s: f64,
}

impl Turn {
    /// The speeds, as one line.
    fn speeds(&self, prompt_len: usize) -> String {
        let decoded = self.generated.len().saturating_sub(1);
        let timed = decoded.saturating_sub(1);
        format!(
            "prefill: {prompt_len} tokens in {:.1} ms ({:.0} tokens/s); decode: {decoded} tokens, {:.2} ms/token after the first step ({:.1} ms: on a GPU it records the step's graph)",
            self.prefill_s * 1e3,
            prompt_len as f64 / self.prefill_s.max(1e-9),
            if timed > 0 { self.decode_s * 1e3 / timed as f64 } else { 0.0 },
            self.first_s * 1e3
        )
    }
}

impl Session<'_> {
    fn params(&self) -> RequestParams {
        RequestParams {
            max_new_tokens: self.args.max_new_tokens,
            sampling: self.args.sampling(),
            stop_tokens: self.eos.clone(),
        }
    }

    /// Generates from `prompt` (a raw prompt's tokens), or chats through `template`.
    fn run<B: Backend>(&self, mut engine: Engine<B>, template: Option<&ChatTemplate>, prompt: &[u32]) -> Result<()> {
        if let Some(template) = template {
            return self.chat(&mut engine, template);
        }
        print!("{}", self.args.prompt.as_deref().unwrap_or_default());
        std::io::stdout().flush()?;
        let turn = self.generate(&mut engine, prompt, &mut |chunk| {
            print!("{chunk}");
            Ok(())
        })?;
        println!();
        if let Some(why) = turn.failed {
            bail!("no token: {why}");
        }
        tracing::info!("{}", turn.speeds(prompt.len()));
        if !turn.logprobs.is_empty() {
            print_logprobs(self.tokenizer, &turn.logprobs)?;
        }
        Ok(())
    }

    /// Runs one request to its end, giving `out` the generated text as the decode stream
    /// lets it through (the prompt's text not included).
    fn generate<B: Backend>(
        &self,
        engine: &mut Engine<B>,
        prompt: &[u32],
        out: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Turn> {
        engine.add(prompt, self.params())?;
        let tokenizer = self.tokenizer;
        let detok = |e| anyhow::anyhow!("detokenizing: {e}");
        // The prompt goes through the decode stream first, unprinted, so the first generated
        // token is decoded in its context (a leading space kept, say).
        let mut stream = tokenizer.decode_stream(true);
        // All the stream gave (the prompt's text, then the generated text), for the final flush.
        let mut emitted = String::new();
        for &t in prompt {
            if let Some(chunk) = stream.step(t).map_err(detok)? {
                emitted.push_str(&chunk);
            }
        }
        // Generated tokens the stream holds back (an incomplete character, a skipped special token).
        let mut held = 0;
        let mut turn = Turn {
            generated: Vec::new(),
            logprobs: Vec::new(),
            failed: None,
            prefill_s: 0.0,
            first_s: 0.0,
            decode_s: 0.0,
        };
        // Decode steps after the first: the first records the step (a CUDA graph on the GPU),
        // which a one-off cost would blur into the per-token time.
        while engine.has_work() {
            let t = Instant::now();
            let events = engine.step()?;
            let dt = t.elapsed().as_secs_f64();
            // A prompt fed in chunks (--max-step-tokens) takes several steps before its first token.
            match turn.generated.len() {
                0 => turn.prefill_s += dt,
                1 => turn.first_s = dt,
                _ => turn.decode_s += dt,
            }
            for e in events {
                if let Some(Finish::Failed(why)) = e.finished {
                    turn.failed = Some(format!("request {}: {why}", e.id));
                    continue;
                }
                turn.generated.push(e.token);
                turn.logprobs.extend(e.logprob.map(|l| (e.token, l, e.top_logprobs.clone())));
                match stream.step(e.token).map_err(detok)? {
                    Some(chunk) => {
                        out(&chunk)?;
                        emitted.push_str(&chunk);
                        held = 0;
                    }
                    None => held += 1,
                }
            }
            std::io::stdout().flush()?;
        }
        if held > 0 {
            // What the stream still holds (bytes of a character never completed), decoded once, lossily.
            let all: Vec<u32> = prompt.iter().chain(&turn.generated).copied().collect();
            let text = tokenizer.decode(&all, true).map_err(detok)?;
            if let Some(rest) = text.strip_prefix(emitted.as_str()) {
                out(rest)?;
            }
        }
        Ok(turn)
    }

    /// The chat: a turn per user message (`--prompt`'s, or each line of stdin until EOF or
    /// `/exit`), the whole conversation rendered through the template each time.
    fn chat<B: Backend>(&self, engine: &mut Engine<B>, template: &ChatTemplate) -> Result<()> {
        let mut kwargs = Map::new();
        if self.args.no_thinking {
            kwargs.insert("enable_thinking".into(), Json::Bool(false));
        }
        let ask = std::io::stdin().is_terminal() && self.args.prompt.is_none();
        let dim = std::io::stdout().is_terminal();
        let mut lines = std::io::stdin().lock().lines();
        let mut messages = Vec::new();
        for n in 1.. {
            let user = match &self.args.prompt {
                Some(p) if n == 1 => p.clone(),
                Some(_) => break,
                None => {
                    if ask {
                        print!("> ");
                        std::io::stdout().flush()?;
                    }
                    match lines.next() {
                        Some(line) => line.context("reading stdin")?,
                        None => break,
                    }
                }
            };
            match user.trim() {
                "/exit" => break,
                // A blank line asks nothing.
                "" if self.args.prompt.is_none() => continue,
                _ => {}
            }
            messages.push(json!({"role": "user", "content": user}));
            let text = template.render(&Json::Array(messages.clone()), None, true, &kwargs)?;
            let prompt = encode(self.tokenizer, &text)?;
            let mut parser = OutputParser::new(ParserOptions {
                reasoning: true,
                starts_in_reasoning: model::chat::prompt_opens_reasoning(&text),
                tools: None,
            });
            let mut shown = Shown { dim, thinking: false, reasoning: String::new(), content: String::new() };
            let turn = self
                .generate(engine, &prompt, &mut |chunk| parser.push(chunk).into_iter().try_for_each(|d| shown.show(d)))
                .with_context(|| {
                    format!("turn {n}: the conversation is {} tokens, --max-len {}", prompt.len(), self.args.max_len)
                })?;
            parser.finish().into_iter().try_for_each(|d| shown.show(d))?;
            shown.close()?;
            println!();
            std::io::stdout().flush()?;
            if let Some(why) = turn.failed {
                bail!("no token: {why}");
            }
            tracing::debug!("turn {n}: {}", turn.speeds(prompt.len()));
            if !turn.logprobs.is_empty() {
                print_logprobs(self.tokenizer, &turn.logprobs)?;
            }
            let mut reply = json!({"role": "assistant", "content": shown.content});
            if !shown.reasoning.is_empty() {
                reply["reasoning_content"] = Json::String(shown.reasoning);
            }
            messages.push(reply);
        }
        Ok(())
    }
}

/// A reply on stdout as it streams: the reasoning dimmed (on a terminal) or between
/// `[think]` and `[/think]`, then the answer; both kept for the conversation.
struct Shown {
    dim: bool,
    /// Inside the reasoning.
    thinking: bool,
    reasoning: String,
    content: String,
}

impl Shown {
    fn show(&mut self, d: Delta) -> Result<()> {
        match d {
            Delta::Reasoning(s) => {
                if !self.thinking {
                    print!("{}", if self.dim { "\x1b[2m" } else { "[think]" });
                    self.thinking = true;
                }
                print!("{s}");
                self.reasoning.push_str(&s);
            }
            Delta::Content(s) => {
                self.close()?;
                print!("{s}");
                self.content.push_str(&s);
            }
            // No tools are offered, so the parser gives no calls.
            Delta::ToolCallStart { name, .. } => tracing::warn!("a tool call to `{name}` (no tools were offered)"),
            Delta::ToolCallArguments { .. } => {}
        }
        Ok(())
    }

    /// Ends the reasoning, if it was shown last.
    fn close(&mut self) -> Result<()> {
        if self.thinking {
            print!("{}", if self.dim { "\x1b[0m" } else { "[/think]" });
            self.thinking = false;
        }
        Ok(())
    }
}

/// A generated token, its log-probability and the most likely tokens' (id, log-probability).
type TokenLogprobs = (u32, f32, Vec<(u32, f32)>);

/// Each generated token's log-probability on stderr (with the most likely tokens' after it,
/// when asked), then their mean (and the perplexity).
fn print_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprobs]) -> Result<()> {
    eprintln!("logprobs (token id, log-probability, text; the most likely tokens after `~`):");
    let text = |id| tokenizer.decode(&[id], false).map_err(|e| anyhow::anyhow!("detokenizing: {e}"));
    for (id, l, top) in logprobs {
        eprintln!("  {id:>7} {l:>10.4} {:?}", text(*id)?);
        for &(t, lt) in top {
            eprintln!("    ~ {t:>7} {lt:>10.4} {:?}", text(t)?);
        }
    }
    if !logprobs.is_empty() {
        let mean = logprobs.iter().map(|(_, l, _)| f64::from(*l)).sum::<f64>() / logprobs.len() as f64;
        eprintln!("logprob: mean {mean:.4} over {} tokens (perplexity {:.3})", logprobs.len(), (-mean).exp());
    }
    Ok(())
}
