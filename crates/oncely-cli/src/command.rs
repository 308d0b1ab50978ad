//! [`Cli`]: a binary's command line — the log format ([`LogArgs`]) and its subcommands.

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use oncely_runtime::LogFormat;

/// How the process logs (`--log-format`, global: accepted after any subcommand).
#[derive(Debug, Clone, Args)]
pub struct LogArgs {
    /// Log format.
    #[arg(long, env = "ONCELY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

impl LogArgs {
    /// Installs the process's logger in this format ([`oncely_runtime::init_logging`]).
    pub fn init(&self) {
        oncely_runtime::init_logging(self.log_format);
    }
}

/// A binary's command line: [`LogArgs`] and the binary's subcommands `C`.
#[derive(Debug, Parser)]
#[command(version)]
pub struct Cli<C: Subcommand> {
    /// How the process logs.
    #[command(flatten)]
    pub log: LogArgs,
    /// The subcommand given.
    #[command(subcommand)]
    pub command: C,
}

impl<C: Subcommand> Cli<C> {
    /// This process's command line as binary `name` (`about`: its one-line help), with
    /// its logger installed. Exits with clap's message (and `--help`, `--version`) on a
    /// command line that does not parse.
    pub fn start(name: &'static str, about: &'static str) -> Self {
        let matches = Self::command().name(name).about(about).get_matches();
        let cli = Self::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        cli.log.init();
        oncely_core::failpoint::setup();
        cli
    }
}
