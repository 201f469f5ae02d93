//! `generate`: generates text with a NemotronH checkpoint (a directory with config.json,
//! safetensors and tokenizer.json, or a Hugging Face repo id, downloaded when not cached, found
//! by [`model::hub`] as `serve` finds it), streaming the text as it comes (the tokenizer's
//! decode stream: each token decoded against the few before it, a character split over tokens
//! printed once complete), then logs prefill and decode speed. Without `--model` it runs the small built-in model
//! (random weights: the text means nothing). The default backend, `auto`, is the GPU when one
//! can be opened and the CPU reference otherwise (it says which and why); `cuda` insists on
//! the GPU. `generate --help` lists the options. It is a thin command line over
//! [`model::text::Llm`], which a Rust program can use the same way.
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

use anyhow::{Context, Result, bail};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use model::chat::Delta;
use model::prefix::{DEFAULT_BUDGET, PrefixSettings, gib_bytes};
use model::sampling::SamplingParams;
use model::text::{Device, Generation, Llm, LoadOptions, TokenLogprobs};
use serde_json::{Value as Json, json};
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
    /// repo id ORG/NAME[@REVISION] from the local cache ($HF_HUB_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub), downloaded into it when missing ($HF_ENDPOINT, $HF_TOKEN;
    /// HF_HUB_OFFLINE=1: never); without it, the built-in model (random weights: the text
    /// means nothing).
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
    /// The context a request may fill (its prompt plus what it generates; with --chat, the
    /// whole conversation plus a reply), in tokens.
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
    /// GiB of the backend's memory for the prefix cache: with --chat, each turn restores the
    /// state after the last instead of computing the whole conversation again (0: off).
    #[arg(long, default_value_t = (DEFAULT_BUDGET >> 30) as f64)]
    prefix_cache_gb: f64,
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
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("  loading layers {bar:40} {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let device = match args.backend {
        Choice::Auto => Device::Auto,
        Choice::Cpu => Device::Cpu,
        Choice::Cuda => Device::Cuda,
    };
    let prefix_budget = gib_bytes(args.prefix_cache_gb).context("--prefix-cache-gb")?;
    let opts = LoadOptions {
        device,
        max_len: args.max_len,
        max_step_tokens: args.max_step_tokens,
        prefix_cache: PrefixSettings::bytes(prefix_budget),
    };
    let llm = Llm::load_with_progress(args.model.as_deref(), &opts, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    let mut llm = llm?;
    let how =
        Generation { max_new_tokens: args.max_new_tokens, sampling: args.sampling(), thinking: !args.no_thinking };
    if args.chat {
        return chat(&mut llm, &args, &how);
    }
    let text = args.prompt.as_deref().unwrap_or_default();
    let prompt = llm.encode(text)?;
    print!("{text}");
    std::io::stdout().flush()?;
    let mut stdout = std::io::stdout();
    let output = llm
        .generate(&prompt, &how, &mut |chunk| {
            write!(stdout, "{chunk}")?;
            stdout.flush()
        })
        .with_context(|| format!("a prompt of {} tokens (--max-len {})", prompt.len(), args.max_len))?;
    println!();
    tracing::info!("{}", output.speeds());
    print_logprobs(llm.tokenizer(), &output.logprobs)
}

/// The chat: a turn per user message (`--prompt`'s, or each line of stdin until EOF or
/// `/exit`), the whole conversation rendered through the template each time.
fn chat(llm: &mut Llm, args: &Args, how: &Generation) -> Result<()> {
    if llm.template().is_none() {
        bail!("{} has no chat template: --chat needs one", llm.dir().display());
    }
    let ask = std::io::stdin().is_terminal() && args.prompt.is_none();
    let dim = std::io::stdout().is_terminal();
    let mut lines = std::io::stdin().lock().lines();
    let mut messages = Vec::new();
    for n in 1.. {
        let user = match &args.prompt {
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
            "" if args.prompt.is_none() => continue,
            _ => {}
        }
        messages.push(json!({"role": "user", "content": user}));
        let mut shown = Shown { dim, thinking: false, reasoning: String::new(), content: String::new() };
        let output = llm
            .chat_stream(&Json::Array(messages.clone()), how, &mut |d| shown.show(d))
            .with_context(|| format!("turn {n} (--max-len {})", args.max_len))?;
        shown.close()?;
        println!();
        std::io::stdout().flush()?;
        tracing::debug!("turn {n}: {}", output.speeds());
        print_logprobs(llm.tokenizer(), &output.logprobs)?;
        let mut reply = json!({"role": "assistant", "content": shown.content});
        if !shown.reasoning.is_empty() {
            reply["reasoning_content"] = Json::String(shown.reasoning);
        }
        messages.push(reply);
    }
    Ok(())
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
    fn show(&mut self, d: Delta) -> std::io::Result<()> {
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
    fn close(&mut self) -> std::io::Result<()> {
        if self.thinking {
            print!("{}", if self.dim { "\x1b[0m" } else { "[/think]" });
            self.thinking = false;
        }
        Ok(())
    }
}

/// Each generated token's log-probability on stderr (with the most likely tokens' after it,
/// when asked), then their mean (and the perplexity); nothing when none were asked for.
fn print_logprobs(tokenizer: &Tokenizer, logprobs: &[TokenLogprobs]) -> Result<()> {
    if logprobs.is_empty() {
        return Ok(());
    }
    eprintln!("logprobs (token id, log-probability, text; the most likely tokens after `~`):");
    let text = |id| tokenizer.decode(&[id], false).map_err(|e| anyhow::anyhow!("detokenizing: {e}"));
    for (id, l, top) in logprobs {
        eprintln!("  {id:>7} {l:>10.4} {:?}", text(*id)?);
        for &(t, lt) in top {
            eprintln!("    ~ {t:>7} {lt:>10.4} {:?}", text(t)?);
        }
    }
    let mean = logprobs.iter().map(|(_, l, _)| f64::from(*l)).sum::<f64>() / logprobs.len() as f64;
    eprintln!("logprob: mean {mean:.4} over {} tokens (perplexity {:.3})", logprobs.len(), (-mean).exp());
    Ok(())
}
