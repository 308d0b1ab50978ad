//! [`HttpLimitArgs`]: the slow-client and connection limits of a command that serves HTTP.

use std::time::Duration;

use clap::Args;
use oncely_http::HttpLimits;

/// The flags of [`HttpLimits`], under the help heading "HTTP limits" (`orders serve`,
/// `oncely gateway`). Each is at least 1.
#[derive(Debug, Clone, Args)]
pub struct HttpLimitArgs {
    /// Seconds a client may take to send a request's head before its connection is closed
    /// (slowloris guard).
    #[arg(
        help_heading = "HTTP limits",
        long,
        env = "ONCELY_HEADER_READ_TIMEOUT_SECS",
        default_value_t = 30
    )]
    pub header_read_timeout_secs: u64,
    /// Seconds a client may take to send a request's whole body after its head (a total
    /// deadline; 408 past it).
    #[arg(
        help_heading = "HTTP limits",
        long,
        env = "ONCELY_BODY_READ_TIMEOUT_SECS",
        default_value_t = 30
    )]
    pub body_read_timeout_secs: u64,
    /// Seconds a response write may stall (the client not reading) before the connection
    /// is closed.
    #[arg(
        help_heading = "HTTP limits",
        long,
        env = "ONCELY_WRITE_TIMEOUT_SECS",
        default_value_t = 30
    )]
    pub write_timeout_secs: u64,
    /// Most connections served at once; more wait in the listen backlog.
    #[arg(
        help_heading = "HTTP limits",
        long,
        env = "ONCELY_MAX_CONNECTIONS",
        default_value_t = 512
    )]
    pub max_connections: usize,
    /// Most request-body bytes buffered at once over all requests; a request beyond it gets
    /// 503 with Retry-After.
    #[arg(help_heading = "HTTP limits", long, env = "ONCELY_MAX_BODY_BYTES_IN_FLIGHT", default_value_t = 64 * 1024 * 1024)]
    pub max_body_bytes_in_flight: usize,
}

impl HttpLimitArgs {
    /// The limits these flags set.
    pub fn limits(&self) -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(self.header_read_timeout_secs.max(1)),
            body_read_timeout: Duration::from_secs(self.body_read_timeout_secs.max(1)),
            write_timeout: Duration::from_secs(self.write_timeout_secs.max(1)),
            max_connections: self.max_connections.max(1),
            max_body_bytes_in_flight: self.max_body_bytes_in_flight.max(1),
        }
    }
}
