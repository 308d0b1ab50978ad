//! [`RuntimeError`].

use std::net::SocketAddr;

use oncely_sql::StoreError;

/// A broker client's error, kept as the source of a [`RuntimeError`] (each broker has its
/// own error type).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Why the runtime could not assemble or run something. The messages say what was being
/// done; the cause is the [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// The database at `url` (password redacted) cannot be connected to.
    #[error("connecting to {url}")]
    Connect {
        /// The database URL, password redacted.
        url: String,
        /// Why.
        #[source]
        source: StoreError,
    },
    /// A SQLite URL names a file that does not exist, for a command that must not create it.
    #[error(
        "no SQLite database at {path:?} (the service's --database-url, relative to its \
         working directory; `oncely migrate` creates one)"
    )]
    NoSqliteFile {
        /// The file the URL names.
        path: String,
    },
    /// The database has not (all of) oncely's migrations applied.
    #[error("no oncely schema in {url} — run `oncely migrate --database-url …` first")]
    SchemaMissing {
        /// The database URL, password redacted.
        url: String,
        /// What is missing.
        #[source]
        source: StoreError,
    },
    /// The configured broker's support is not compiled in (the feature of that name of
    /// oncely-runtime is off).
    #[error("this build has no {broker} support (feature `{broker}` of oncely-runtime)")]
    BrokerNotBuilt {
        /// `rabbitmq`, `nats` or `kafka`.
        broker: &'static str,
    },
    /// The SQL transport's dead letters were asked for without its database.
    #[error("the SQL transport's dead letters live in the database: give --database-url")]
    DatabaseRequired,
    /// RabbitMQ cannot be connected to.
    #[error("connecting to RabbitMQ")]
    RabbitMqConnect(#[source] BoxError),
    /// NATS cannot be connected to.
    #[error("connecting to NATS")]
    NatsConnect(#[source] BoxError),
    /// The JetStream stream cannot be created or checked.
    #[error("creating stream {stream}")]
    NatsStream {
        /// The stream's name.
        stream: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// A NATS consumer was configured without a stream to read.
    #[error("a NATS consumer needs --nats-stream (the stream the relay publishes to)")]
    NatsStreamRequired,
    /// A Kafka topic cannot be created or checked.
    #[error("creating Kafka topic {topic}")]
    KafkaTopic {
        /// The topic.
        topic: String,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// The Kafka producer cannot be created (a bad configuration; librdkafka connects
    /// lazily).
    #[error("creating the Kafka producer")]
    KafkaProducer(#[source] BoxError),
    /// A listener cannot be bound.
    #[error("binding {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Payments are configured without a secret key.
    #[error("payments need a secret key (--payments-secret-key / ONCELY_PAYMENTS_SECRET_KEY)")]
    PaymentsSecretKeyMissing,
    /// The effect runner's lease does not exceed a provider's timeout: a call still running
    /// could be taken over by another runner.
    #[error("the runner's lease ({lease:?}) must exceed the provider timeout ({timeout:?})")]
    LeaseTooShort {
        /// The runner's lease.
        lease: std::time::Duration,
        /// The provider's timeout.
        timeout: std::time::Duration,
    },
    /// A provider's HTTP client cannot be built.
    #[error("building the {provider} client")]
    ProviderClient {
        /// `payments` or `shipping`.
        provider: &'static str,
        /// Why.
        #[source]
        source: BoxError,
    },
    /// An effect runner was asked for without any provider configured.
    #[error("no provider configured (--payments-url, --shipping-url)")]
    NoProviders,
    /// A task of the runtime panicked or was aborted.
    #[error("a runtime task failed")]
    Task(#[from] tokio::task::JoinError),
}
