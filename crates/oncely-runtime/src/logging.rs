//! The `tracing` subscriber.

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum LogFormat {
    /// Human-readable lines (coloured only on a terminal).
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The log filter when `ONCELY_LOG` is not set: `info`, without lapin's own lines. lapin
/// logs every failed reconnection (three `ERROR` lines per attempt: "error doing IO",
/// "Connection error", …) and dumps every message RabbitMQ returns as unroutable (`WARN`,
/// about 2 KB each, payload included); what matters of both reaches our own errors, which
/// the relay and the consumers log once per state change of the broker (down with the
/// root cause, up with the outage's length) or per dead event (`no destination for topic
/// …`, the row's `last_error`). `ONCELY_LOG=info,lapin=warn` brings lapin's lines back.
///
/// sqlx and async_nats are held at `warn`: sqlx logs every statement's server notices at
/// `info` (`relation "_sqlx_migrations" already exists`, `trigger … does not exist,
/// skipping` on every start) and async_nats five lines per connection; neither says
/// anything an operator acts on that our own lines do not.
pub const DEFAULT_LOG_FILTER: &str = "info,sqlx=warn,async_nats=warn,lapin=off";

/// Installs the process's `tracing` subscriber: lines to stderr in `format`, filtered by
/// `ONCELY_LOG` (an `EnvFilter` directive, e.g. `debug,sqlx=warn`) or else
/// [`DEFAULT_LOG_FILTER`].
///
/// # Panics
/// When a global subscriber is already installed (call it once, first thing in `main`).
pub fn init_logging(format: LogFormat) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::try_from_env("ONCELY_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    // Colour codes only for a person at a terminal; a pipe or a file gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
