use std::fmt;
use std::sync::Arc;

/// The underlying error a broker client or the SQL transport's database reported: the
/// client's own error type, or a description where the client gave none. Cheap to clone,
/// so one failure can answer every message of a batch.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync + 'static>);

impl Cause {
    /// Wraps a client's error (its [`source`](std::error::Error::source) chain is kept).
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(error))
    }

    /// A cause known only by its description (a protocol answer that is not an error type
    /// of the client, e.g. an AMQP `nack`).
    pub fn msg(text: impl Into<String>) -> Self {
        Self(Arc::new(Described(text.into())))
    }

    /// The wrapped error.
    pub fn get(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&*self.0, f)
    }
}

impl std::error::Error for Cause {
    // The wrapped error's own source: `Cause` is transparent, it adds no line to a chain.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Described(String);

impl From<String> for Cause {
    fn from(text: String) -> Self {
        Self::msg(text)
    }
}

impl From<&str> for Cause {
    fn from(text: &str) -> Self {
        Self::msg(text)
    }
}

/// A failure that says nothing about the message or the operation: the broker, or the way
/// to it, is down or did not answer in time. Retrying the same thing later can succeed, so
/// it never counts as an attempt of a message (docs/DESIGN.md: "nothing goes dead because a
/// dependency was down").
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransientError {
    /// The broker cannot be reached or the connection broke; the client reconnects on the
    /// next call.
    #[error("broker unreachable: {0}")]
    Unavailable(#[source] Cause),
    /// The broker did not answer within the timeout, ms (a publish: the message may or may
    /// not have been stored; the outcome is unknown, not failed).
    #[error("no confirmation within {0} ms")]
    Timeout(u64),
}

/// A failure that is the message's or the operation's own: the broker answered and refused
/// it. Retrying it unchanged fails again (except [`PermanentError::Unroutable`], which a
/// new binding or stream can cure; the relay retries it up to its attempt limit).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum PermanentError {
    /// The broker refused (AMQP nack, JetStream error, declaration mismatch, missing
    /// stream, SQL error).
    #[error("broker refused: {0}")]
    Rejected(#[source] Cause),
    /// No queue or stream takes the message (AMQP `basic.return` of a mandatory message,
    /// JetStream "no responders", an unknown Kafka topic): publishing it would lose it.
    #[error("no destination for topic {0:?}")]
    Unroutable(String),
    /// The message exceeds the transport's size limit.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Payload size, bytes.
        size: usize,
        /// Limit, bytes.
        limit: usize,
    },
}
