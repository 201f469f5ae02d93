//! Logging for the binaries: tracing to stderr, filtered by `RUST_LOG` (`info` without it),
//! colour only on a terminal. Standard output stays for what a binary produces.

use std::io::IsTerminal;

/// Installs the process's tracing subscriber, lines of text; call it once, first thing in
/// `main`.
pub fn init() {
    init_as(false);
}

/// [`init`], each event one JSON object a line where `json` (timestamp, level, target and
/// fields: `serve --log-format json`, for log collectors).
pub fn init_as(json: bool) {
    let fmt = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr);
    if json {
        fmt.json().init();
    } else {
        fmt.with_ansi(std::io::stderr().is_terminal()).init();
    }
}
