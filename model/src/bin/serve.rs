//! `serve`: an OpenAI-compatible HTTP server for a NemotronH checkpoint (the library's
//! `model::serve` has the routes and the engine thread). `--model` takes a checkpoint
//! directory or a Hugging Face repo id, downloaded when not in the cache ([`model::hub`]); without
//! it, the built-in model; `--synthetic CONFIG` random weights of any size made in memory, for
//! benchmarks (`serve_bench`). Logs go to stderr through tracing (`RUST_LOG=debug` shows each request):
//! `listening on http://ADDR` once the port is bound, before the model loads (every request
//! gets 503 until then, `/health` `{"status": "loading"}`), and `ready on http://ADDR` once it
//! serves.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, ValueEnum};
use model::config::Config;
use model::cpu::Cpu;
use model::cuda::Cuda;
use model::engine::Engine;
use model::layout::Layout;
use model::model::Model;
use model::prefix::{DEFAULT_BUDGET, PrefixSettings, gib_bytes};
use model::serve::conn::{self, ConnLimits};
use model::serve::prompt::Chat;
use model::serve::request::Limits;
use model::serve::special::{Special, SpecialInContent};
use model::serve::worker::{EngineHandle, Starter};
use model::serve::{Access, Served, loading, now, router};
use model::structured::Structured;
use tokenizers::Tokenizer;

/// How the log is written.
#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// Which backend runs the model.
#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Backend {
    /// The GPU when one can be opened, else the CPU reference backend.
    Auto,
    /// The CPU reference backend.
    Cpu,
    /// The CUDA backend (an error without a GPU).
    Cuda,
}

/// Serves a NemotronH model over the OpenAI API: /v1/chat/completions, /v1/completions,
/// /v1/models, vLLM's /tokenize and /detokenize, /metrics, /health.
#[derive(Parser, Debug)]
#[command(name = "serve", version)]
struct Args {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a Hugging Face
    /// repo id ORG/NAME[@REVISION] from the local cache ($HF_HUB_CACHE, $HF_HOME/hub or
    /// ~/.cache/huggingface/hub), downloaded into it when missing ($HF_ENDPOINT, $HF_TOKEN;
    /// HF_HUB_OFFLINE=1: never); without it, the built-in model (random weights: the text
    /// means nothing).
    #[arg(long)]
    model: Option<String>,
    /// Instead of a checkpoint, random bf16 weights made in memory for this config.json (as
    /// `cargo bench --bench nano` makes them; model/assets/nano-30b-a3b.json is Nemotron-3 Nano
    /// 30B-A3B's), with the built-in model's tokenizer (a token added for each id past its
    /// vocabulary, so that every token has text) and chat template: for serving benchmarks.
    #[arg(long, conflicts_with = "model")]
    synthetic: Option<PathBuf>,
    /// The name clients give as `model` (default: the repo id, the directory's name, or
    /// `default`).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Which backend runs the model.
    #[arg(long, value_enum, default_value_t = Backend::Auto)]
    backend: Backend,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free one; the log says which).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests the engine runs at once (its state slots).
    #[arg(long, default_value_t = 16)]
    slots: usize,
    /// The context of a request: its prompt plus generated tokens.
    #[arg(long, default_value_t = 4096)]
    max_len: usize,
    /// Requests that may wait for a slot; past them a request gets 429 (with the slots, counted
    /// up to the largest `usize`: a larger sum admits without bound).
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Feed at most this many tokens per engine step: prompts in chunks, so that decoding
    /// streams keep their pace while long prompts arrive (0: no bound, each prompt whole).
    #[arg(long, default_value_t = STEP_TOKENS)]
    max_step_tokens: usize,
    /// GiB of the backend's memory for the prefix cache: the states after prompts, requests
    /// and shared prefixes, restored for the requests that start with them (0: off).
    #[arg(long, default_value_t = (DEFAULT_BUDGET >> 30) as f64)]
    prefix_cache_gb: f64,
    /// The fewest tokens a prefix cache snapshot adds to what its request restored or saved.
    #[arg(long, default_value_t = PrefixSettings::bytes(0).min_tokens)]
    prefix_cache_min_tokens: usize,
    /// Most `stop` strings a request may give (each is matched against all the text generated).
    #[arg(long, default_value_t = Limits::default().max_stop)]
    max_stop: usize,
    /// Most bytes of each `stop` string.
    #[arg(long, default_value_t = Limits::default().max_stop_bytes)]
    max_stop_bytes: usize,
    /// What becomes of special-token text (`<|im_end|>`, ...) in chat content: `allow` keeps it
    /// as the control tokens it spells (as vLLM does: a user can then close their turn and open
    /// another), `refuse` answers 400, `escape` tokenizes it as plain text.
    #[arg(long, value_enum, default_value_t = SpecialInContent::Allow)]
    special_tokens_in_content: SpecialInContent,
    /// The API key clients must send (`Authorization: Bearer KEY`) to the `/v1/` routes (else
    /// 401; `/health` stays open). It shows in the process list: keep the machine's users in mind.
    #[arg(long)]
    api_key: Option<String>,
    /// Origins whose browser pages may call the API (CORS), comma-separated
    /// `http(s)://HOST[:PORT]`, or `*` for any; none by default.
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Vec<String>,
    /// How the log (stderr) is written: lines of text, or one JSON object a line.
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Seconds the requests in flight have to finish after SIGTERM or SIGINT (new connections
    /// get 503 meanwhile); then the generations still running end with finish reason `abort`
    /// (a stream with its final chunk and `[DONE]`) and the server exits 0.
    #[arg(long, default_value_t = 30)]
    shutdown_timeout: u64,
    /// Most connections open at once; past them a new one gets 503 (lowered to fit the
    /// process's descriptor limit, `ulimit -n`).
    #[arg(long, default_value_t = ConnLimits::default().max)]
    max_connections: usize,
    /// Seconds a client has to send a request's headers, from connecting or from its last
    /// response (an idle connection is closed after them).
    #[arg(long, default_value_t = ConnLimits::default().header.as_secs())]
    header_timeout: u64,
    /// Seconds a client has to send a request's body once its headers are in (408 past them).
    #[arg(long, default_value_t = ConnLimits::default().body.as_secs())]
    body_timeout: u64,
}

fn main() -> Result<()> {
    let args = Args::parse();
    model::logs::init_as(args.log_format == LogFormat::Json);
    if args.slots == 0 || args.max_len < 2 {
        bail!("--slots must be at least 1 and --max-len at least 2");
    }
    let prefix_budget = gib_bytes(args.prefix_cache_gb).context("--prefix-cache-gb")?;
    if args.max_connections == 0 || args.header_timeout == 0 || args.body_timeout == 0 {
        bail!("--max-connections, --header-timeout and --body-timeout must be at least 1");
    }
    let access = Access { api_key: args.api_key.clone(), allowed_origins: args.allowed_origins.clone() };
    access.check().map_err(|e| anyhow::anyhow!("--api-key / --allowed-origins: {e}"))?;
    let conns = ConnLimits {
        max: conn::fitted_max(args.max_connections),
        header: Duration::from_secs(args.header_timeout),
        body: Duration::from_secs(args.body_timeout),
    };
    // With --synthetic (never beside --model), the built-in model's tokenizer and template.
    let model::hub::Located { dir, name } = model::hub::resolve(args.model.as_deref()).map_err(anyhow::Error::msg)?;
    let name = args.served_model_name.clone().unwrap_or(name);
    let weights = match &args.synthetic {
        Some(path) => {
            let json = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            tracing::info!("random weights for {}", path.display());
            Weights::Random(Box::new(Config::from_json(&json)?))
        }
        None => {
            tracing::info!("loading {}", dir.display());
            Weights::Checkpoint(dir.clone())
        }
    };
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.exists() {
        bail!("{} has no tokenizer.json: the server needs the checkpoint's tokenizer", dir.display());
    }
    let mut tokenizer =
        Tokenizer::from_file(&tok_path).map_err(|e| anyhow::anyhow!("reading {}: {e}", tok_path.display()))?;
    if let Weights::Random(config) = &weights {
        model::synthetic::fill_vocabulary(&mut tokenizer, config.vocab_size);
    }
    let chat = Chat::from_dir(&dir).map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?;
    let special = Special::new(&tokenizer, args.special_tokens_in_content).map_err(anyhow::Error::msg)?;
    let sizes = EngineSizes {
        slots: args.slots,
        max_len: args.max_len,
        max_step_tokens: (args.max_step_tokens > 0).then_some(args.max_step_tokens),
        prefix: PrefixSettings {
            budget: prefix_budget,
            min_tokens: args.prefix_cache_min_tokens,
            turn_start: model::chat::turn_start(&tokenizer),
        },
    };
    let backend = args.backend;
    let start = move |start: Starter| {
        let load = |start: Starter, b| match b {
            None => {
                tracing::info!("backend: CPU reference");
                start.run(load_engine(Cpu::default(), &weights, &sizes))
            }
            Some(cuda) => start.run(load_engine(cuda, &weights, &sizes)),
        };
        match backend {
            Backend::Cpu => load(start, None),
            Backend::Cuda => match Cuda::new(0) {
                Ok(c) => load(start, Some(c)),
                Err(e) => start.run::<Cpu>(Err(e)),
            },
            Backend::Auto => {
                let gpu = Cuda::new(0).map_err(|e| tracing::info!("no GPU ({e}): using the CPU reference backend"));
                load(start, gpu.ok())
            }
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    runtime.block_on(async move {
        // The port first (a clash shows before the load), answering 503 until the model is in.
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        tracing::info!(max_connections = conns.max, "listening on http://{local} (503 until the model has loaded)");
        let ready = Arc::new(OnceLock::new());
        let (drain, drained) = tokio::sync::watch::channel(false);
        let mut server = tokio::spawn(conn::serve(listener, loading(ready.clone()), conns, drained));
        let max_queue = args.max_queue;
        let load = tokio::task::spawn_blocking(move || EngineHandle::spawn(max_queue, start));
        let engine = tokio::select! {
            engine = load => engine?.context("loading the model")?,
            signal = shutdown_signal() => {
                tracing::info!("{signal} while the model loads: exiting");
                std::process::exit(0);
            }
        };
        let info = engine.info;
        tracing::info!(slots = info.slots, max_len = info.max_len, max_queue, "model `{name}` loaded");
        let limits = Limits { max_stop: args.max_stop, max_stop_bytes: args.max_stop_bytes };
        // Structured outputs: the vocabulary as llguidance sees it, made once (the tokenizer as
        // served: with --synthetic, stretched to the config's vocabulary).
        let t = Instant::now();
        let structured = Structured::new(&tokenizer, info.vocab, &chat.stop_ids());
        match &structured {
            Ok(_) => tracing::info!("structured outputs ready in {:.2} s", t.elapsed().as_secs_f64()),
            Err(e) => tracing::warn!("no structured outputs: {e}"),
        }
        let tokenizer = Arc::new(tokenizer);
        let (ending, created, metrics) = (Default::default(), now(), Default::default());
        let state = Arc::new(Served {
            name,
            tokenizer,
            chat,
            engine,
            created,
            limits,
            special,
            ending,
            access,
            metrics,
            structured,
        });
        if ready.set(router(state.clone())).is_err() {
            bail!("the router was set twice");
        }
        tracing::info!("ready on http://{local}");
        let signal = tokio::select! {
            served = &mut server => return served.context("serving")?.context("serving"),
            signal = shutdown_signal() => signal,
        };
        // Graceful: no new connections (503), the requests in flight finish until the deadline,
        // then the generations still running end with `abort` and the connections close.
        let timeout = Duration::from_secs(args.shutdown_timeout);
        tracing::info!("{signal}: shutting down, requests in flight have {} s to finish", timeout.as_secs());
        drain.send_replace(true);
        if tokio::time::timeout(timeout, &mut server).await.is_err() {
            tracing::info!("ending the generations still running (finish reason `abort`)");
            state.ending.cut();
            if tokio::time::timeout(Duration::from_secs(5), &mut server).await.is_err() {
                tracing::warn!("connections still open 5 s after the generations ended: exiting anyway");
            }
        }
        tracing::info!("shut down");
        Ok(())
    })
}

/// SIGTERM or SIGINT (Ctrl-C), by name, once one arrives.
async fn shutdown_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::warn!("no signal handlers: SIGTERM and SIGINT end the server at once");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    }
}

/// `--max-step-tokens` by default, the largest of those measured that keeps decoding streams
/// within twice their pace while long prompts arrive. On the H200 (`serve --synthetic
/// model/assets/nano-30b-a3b.json --slots 64`, `serve_bench --mixed`: 32 streams decoding, a
/// 3972-token prompt every second) the streams' inter-token p99 was 70.96 ms unbounded, 33.05
/// at 1024, 27.92 at 512 and 25.60 at 256, against a median of 19.6 without long prompts; the
/// prompt alone took 73.2 ms whole, 123.1 in chunks of 1024 (each chunk's step reads every
/// expert), 202.7 of 512, 372.5 of 256.
const STEP_TOKENS: usize = 1024;

/// Where the weights come from.
enum Weights {
    /// A checkpoint directory.
    Checkpoint(PathBuf),
    /// Random, for this config (`--synthetic`).
    Random(Box<Config>),
}

/// What the engine holds and how much it takes at once.
#[derive(Clone, Copy)]
struct EngineSizes {
    slots: usize,
    max_len: usize,
    max_step_tokens: Option<usize>,
    prefix: PrefixSettings,
}

/// The engine over `backend` with `weights` loaded.
fn load_engine<B: model::backend::Backend>(
    backend: B,
    weights: &Weights,
    sizes: &EngineSizes,
) -> model::Result<Engine<B>> {
    let EngineSizes { slots, max_len, max_step_tokens, prefix } = *sizes;
    let model = match weights {
        Weights::Checkpoint(dir) => Model::from_dir(backend, dir, slots, max_len, &mut |_, _| {})?,
        Weights::Random(config) => {
            // One buffer per kind of tensor (benches/nano.rs's seed), finite as drawn: not scanned.
            let checkpoint = model::synthetic::in_memory(config, 7)?;
            let mut model =
                Model::load(backend, config, &Layout::trusting_values(config, &checkpoint)?, slots, max_len)?;
            // Routed as a trained model routes (every expert its share of the tokens).
            let loads = model::synthetic::balance_routers(&mut model)?;
            let touched = loads.iter().map(|l| l.touched()).min().unwrap_or(0);
            tracing::info!(
                "synthetic routers fitted: every MoE layer spreads its fitting tokens over {touched} or more experts"
            );
            model
        }
    };
    let shape = model.snapshot_shape();
    let mut engine = Engine::new(model);
    if let Some(n) = max_step_tokens {
        engine.set_max_step_tokens(n)?;
    }
    if prefix.budget > 0 {
        let mib = |b: usize| b as f64 / f64::from(1 << 20);
        tracing::info!(
            "prefix cache: {:.2} GiB; a snapshot takes {:.2} MiB and {:.1} KiB a token, at least {} tokens apart",
            mib(prefix.budget) / 1024.0,
            mib(shape.bytes(0)),
            mib(shape.bytes(1) - shape.bytes(0)) * 1024.0,
            prefix.min_tokens
        );
    } else {
        tracing::info!("prefix cache: off");
    }
    engine.set_prefix_cache(prefix);
    Ok(engine)
}
