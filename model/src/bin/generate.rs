//! `generate [--model DIR] --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K]
//! [--top-p P] [--min-p P] [--repetition-penalty R] [--presence-penalty P]
//! [--frequency-penalty F] [--seed S] [--logprobs] [--top-logprobs N]
//! [--backend auto|cpu|cuda] [--max-step-tokens N]`: generates text with a NemotronH checkpoint directory (config.json,
//! safetensors, tokenizer.json), streaming the text as it comes (the tokenizer's decode stream:
//! each token decoded against the few before it, a character split over tokens printed once
//! complete), then prints prefill and decode speed. Without `--model` it runs the small
//! built-in model (random weights: the text means nothing). The default backend, `auto`, is
//! the GPU when one can be opened and the CPU reference otherwise (it says which and why);
//! `cuda` insists on the GPU.
//!
//! Sampling (model::sampling): temperature 0 (the default) is greedy; otherwise top-k, top-p
//! and min-p truncate, the repetition / presence / frequency penalties apply to the tokens
//! generated so far, and the seed fixes the draws. Bad values are refused before the model
//! loads, naming the parameter. `--logprobs` prints each generated token's log-probability
//! (under the penalized logits at temperature 1) and their mean on stderr at the end;
//! `--top-logprobs N` (at most 20) also the N most likely tokens' at each step. A
//! request left without a token (its logits NaN, or all `-inf`) is an error: exit status 1.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use model::backend::Backend;
use model::config::Config;
use model::cpu::Cpu;
use model::cuda::Cuda;
use model::engine::{Engine, Finish, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;
use model::weights::Checkpoint;
use tokenizers::Tokenizer;

const USAGE: &str = "usage: generate [--model DIR] --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] \
[--top-p P] [--min-p P] [--repetition-penalty R] [--presence-penalty P] [--frequency-penalty F] [--seed S] [--logprobs] [--top-logprobs N] \
[--backend auto|cpu|cuda] [--max-step-tokens N]";

/// Which backend runs the model.
#[derive(Clone, Copy, PartialEq)]
enum Choice {
    Auto,
    Cpu,
    Cuda,
}

struct Args {
    model: Option<PathBuf>,
    backend: Choice,
    /// The engine's bound on tokens per step (prompts fed in chunks); none by default.
    max_step_tokens: Option<usize>,
    prompt: String,
    max_new: usize,
    sampling: SamplingParams,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        model: None,
        backend: Choice::Auto,
        max_step_tokens: None,
        prompt: String::new(),
        max_new: 32,
        sampling: SamplingParams::greedy(),
    };
    let mut it = std::env::args().skip(1);
    let mut prompt = None;
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--model" => a.model = Some(value()?.into()),
            "--prompt" => prompt = Some(value()?),
            "--max-new-tokens" => a.max_new = value()?.parse().context("--max-new-tokens")?,
            "--temperature" => a.sampling.temperature = value()?.parse().context("--temperature")?,
            "--top-k" => a.sampling.top_k = Some(value()?.parse().context("--top-k")?),
            "--top-p" => a.sampling.top_p = Some(value()?.parse().context("--top-p")?),
            "--min-p" => a.sampling.min_p = Some(value()?.parse().context("--min-p")?),
            "--repetition-penalty" => {
                a.sampling.repetition_penalty = value()?.parse().context("--repetition-penalty")?
            }
            "--presence-penalty" => a.sampling.presence_penalty = value()?.parse().context("--presence-penalty")?,
            "--frequency-penalty" => a.sampling.frequency_penalty = value()?.parse().context("--frequency-penalty")?,
            "--seed" => a.sampling.seed = value()?.parse().context("--seed")?,
            "--logprobs" => a.sampling.logprobs = true,
            "--top-logprobs" => a.sampling.top_logprobs = value()?.parse().context("--top-logprobs")?,
            "--max-step-tokens" => a.max_step_tokens = Some(value()?.parse().context("--max-step-tokens")?),
            "--backend" => {
                a.backend = match value()?.as_str() {
                    "auto" => Choice::Auto,
                    "cpu" => Choice::Cpu,
                    "cuda" => Choice::Cuda,
                    other => bail!("unknown backend `{other}` (auto, cpu, cuda)\n{USAGE}"),
                }
            }
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}`\n{USAGE}"),
        }
    }
    a.prompt = prompt.with_context(|| format!("--prompt is required\n{USAGE}"))?;
    // Refused here, before the model loads (the engine would refuse the request anyway).
    a.sampling.check().map_err(|e| anyhow::anyhow!("{e}\n{USAGE}"))?;
    Ok(a)
}

/// The end-of-sequence ids config.json names (a number or a list), if any.
fn main() -> Result<()> {
    let args = parse()?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => model::built_in::dir()?,
    };
    let t0 = Instant::now();
    eprintln!("loading {}", dir.display());
    let config = Config::from_dir(&dir)?;
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        bail!("{} has no tokenizer.json: the CLI needs the checkpoint's tokenizer", dir.display());
    }
    let tokenizer =
        Tokenizer::from_file(&tok_path).map_err(|e| anyhow::anyhow!("reading {}: {e}", tok_path.display()))?;
    let ck = Checkpoint::open(&dir)?;
    eprintln!("  {} tensors, {:.1} MB mapped", ck.names().count(), ck.total_bytes() as f64 / 1e6);
    let layout = Layout::new(&config, &ck)?;
    let prompt: Vec<u32> = tokenizer
        .encode(args.prompt.as_str(), false)
        .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
        .get_ids()
        .to_vec();
    let max_len = prompt.len().checked_add(args.max_new).with_context(|| {
        format!("a prompt of {} tokens plus --max-new-tokens {} overflows", prompt.len(), args.max_new)
    })?;
    let gpu = match args.backend {
        Choice::Cpu => None,
        Choice::Cuda => Some(Cuda::new(0)?),
        Choice::Auto => Cuda::new(0).map_err(|e| eprintln!("  no GPU ({e}): using the CPU reference backend")).ok(),
    };
    match gpu {
        Some(cuda) => {
            eprintln!("  backend: CUDA ({})", cuda.gpu().name().unwrap_or_default());
            run(cuda, &args, &config, &layout, &tokenizer, &prompt, max_len, &dir, t0)
        }
        None => {
            eprintln!("  backend: CPU reference");
            run(Cpu::default(), &args, &config, &layout, &tokenizer, &prompt, max_len, &dir, t0)
        }
    }
}

/// Loads the model on `backend` and generates.
#[allow(clippy::too_many_arguments)]
fn run<B: Backend>(
    backend: B,
    args: &Args,
    config: &Config,
    layout: &Layout,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    max_len: usize,
    dir: &Path,
    t0: Instant,
) -> Result<()> {
    let model = Model::load_with_progress(backend, config, layout, 1, max_len, &mut |done, total| {
        eprint!("\r  layer {done}/{total}");
        if done == total {
            eprintln!();
        }
    })?;
    eprintln!("  loaded in {:.2} s; prompt: {} tokens", t0.elapsed().as_secs_f64(), prompt.len());
    let mut engine = Engine::new(model);
    if let Some(n) = args.max_step_tokens {
        engine.set_max_step_tokens(n)?;
    }
    engine.add(
        prompt,
        RequestParams {
            max_new_tokens: args.max_new,
            sampling: args.sampling,
            stop_tokens: model::chat::generation_eos_ids(dir),
        },
    )?;

    print!("{}", args.prompt);
    std::io::stdout().flush()?;
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
    let mut generated = Vec::new();
    let mut logprobs = Vec::new();
    let mut failed = None;
    // Decode steps after the first: the first records the step (a CUDA graph on the GPU),
    // which a one-off cost would blur into the per-token time.
    let (mut prefill_s, mut first_s, mut decode_s) = (0.0, 0.0, 0.0);
    while engine.has_work() {
        let t = Instant::now();
        let events = engine.step()?;
        let dt = t.elapsed().as_secs_f64();
        // A prompt fed in chunks (--max-step-tokens) takes several steps before its first token.
        match generated.len() {
            0 => prefill_s += dt,
            1 => first_s = dt,
            _ => decode_s += dt,
        }
        for e in events {
            if let Some(Finish::Failed(why)) = e.finished {
                failed = Some((e.id, why));
                continue;
            }
            generated.push(e.token);
            logprobs.extend(e.logprob.map(|l| (e.token, l, e.top_logprobs.clone())));
            match stream.step(e.token).map_err(detok)? {
                Some(chunk) => {
                    print!("{chunk}");
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
        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let text = tokenizer.decode(&all, true).map_err(detok)?;
        if let Some(rest) = text.strip_prefix(emitted.as_str()) {
            print!("{rest}");
        }
    }
    println!();
    if let Some((id, why)) = failed {
        bail!("request {id}: no token: {why}");
    }
    let decoded = generated.len().saturating_sub(1);
    let timed = decoded.saturating_sub(1);
    eprintln!(
        "prefill: {} tokens in {:.1} ms ({:.0} tokens/s); decode: {decoded} tokens, {:.2} ms/token after the first step ({:.1} ms: on a GPU it records the step's graph)",
        prompt.len(),
        prefill_s * 1e3,
        prompt.len() as f64 / prefill_s.max(1e-9),
        if timed > 0 { decode_s * 1e3 / timed as f64 } else { 0.0 },
        first_s * 1e3
    );
    if !logprobs.is_empty() {
        print_logprobs(tokenizer, &logprobs)?;
    }
    Ok(())
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
