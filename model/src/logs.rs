//! Logging for the binaries: tracing to stderr, filtered by `RUST_LOG` (`info` without it),
//! colour only on a terminal. Standard output stays for what a binary produces.

use std::io::IsTerminal;

/// Installs the process's tracing subscriber; call it once, first thing in `main`.
pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
