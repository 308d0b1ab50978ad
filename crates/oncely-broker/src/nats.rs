use std::time::Duration;

use async_nats::jetstream;
use async_nats::jetstream::context::{PublishAckFuture, PublishErrorKind};

use crate::{BoxFuture, Message, PublishError, Publisher, TransientError};

/// Connects to the server at `url` as client `name` within `timeout`; a timeout or a refusal
/// is the server being unavailable ([`TransientError::Unavailable`]).
pub(crate) async fn connect_client(
    url: &str,
    name: String,
    timeout: Duration,
) -> Result<async_nats::Client, TransientError> {
    let gone = |e: String| TransientError::Unavailable(e.into());
    tokio::time::timeout(
        timeout,
        async_nats::ConnectOptions::new().name(name).connect(url),
    )
    .await
    .map_err(|_| gone("connect timed out".to_owned()))?
    .map_err(|e| gone(e.to_string()))
}

/// The JetStream context kept in `slot`, connected ([`connect_client`]) and kept there when
/// there is none yet.
pub(crate) async fn cached_context(
    slot: &tokio::sync::Mutex<Option<jetstream::Context>>,
    url: &str,
    name: String,
    timeout: Duration,
) -> Result<jetstream::Context, TransientError> {
    let mut guard = slot.lock().await;
    if let Some(js) = guard.as_ref() {
        return Ok(js.clone());
    }
    let js = jetstream::new(connect_client(url, name, timeout).await?);
    *guard = Some(js.clone());
    Ok(js)
}

/// Settings of [`NatsPublisher`].
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// How long a window may wait for its PubAcks. Default 10 s.
    pub ack_timeout: Duration,
    /// Most messages awaiting a PubAck at once. Default 256.
    pub max_in_flight: usize,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
}

impl NatsConfig {
    /// Defaults for `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ack_timeout: Duration::from_secs(10),
            max_in_flight: 256,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// Publishes to NATS JetStream with async-nats: the message's topic is the subject, the
/// message id goes in `Nats-Msg-Id` (so the stream drops a republished copy within its
/// duplicate window, 2 min by default), every header of [`Message::all_headers`] is a NATS
/// header. A message counts as published when its PubAck arrives (a PubAck flagged
/// `duplicate` too: the stream already holds it). A subject no stream captures fails with
/// [`PermanentError::Unroutable`](crate::PermanentError::Unroutable).
///
/// The client reconnects by itself after a broken connection; publishes in between fail
/// (or time out) and are retried by the relay with the same id.
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    js: jetstream::Context,
    config: NatsConfig,
}

impl NatsPublisher {
    /// Connects to the server.
    ///
    /// # Errors
    /// [`TransientError::Unavailable`](crate::TransientError::Unavailable) when the server cannot
    /// be reached in [`NatsConfig::connect_timeout`].
    pub async fn connect(config: NatsConfig) -> Result<Self, PublishError> {
        let client = connect_client(
            &config.url,
            "oncely-relay".to_owned(),
            config.connect_timeout,
        )
        .await?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(config.ack_timeout);
        Ok(Self { client, js, config })
    }

    /// Creates the stream `name` capturing `subjects` unless a stream of that name exists
    /// (an existing stream is left as it is).
    ///
    /// # Errors
    /// [`PermanentError::Rejected`](crate::PermanentError::Rejected) when the server refuses (e.g.
    /// the subjects overlap another stream's).
    pub async fn ensure_stream(&self, name: &str, subjects: &[String]) -> Result<(), PublishError> {
        self.js
            .get_or_create_stream(jetstream::stream::Config {
                name: name.to_owned(),
                subjects: subjects.to_vec(),
                ..jetstream::stream::Config::default()
            })
            .await
            .map(drop)
            .map_err(|e| PublishError::rejected(e.to_string()))
    }

    /// The JetStream context (tests and tools read streams through it).
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// The underlying client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The NATS headers sent with `m`: `Nats-Msg-Id` = message id (JetStream's
    /// de-duplication key) and every header of [`Message::all_headers`]. Public so
    /// benchmarks can publish the very same messages with the raw client.
    pub fn headers(m: &Message) -> async_nats::HeaderMap {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            m.id.to_string().as_str(),
        );
        for (k, v) in m.all_headers() {
            headers.insert(k.as_str(), v.as_str());
        }
        headers
    }

    fn map_error(
        e: &jetstream::context::PublishError,
        m: &Message,
        timeout_ms: u64,
    ) -> PublishError {
        match e.kind() {
            PublishErrorKind::StreamNotFound => PublishError::unroutable(m.topic.clone()),
            PublishErrorKind::TimedOut => PublishError::timeout(timeout_ms),
            PublishErrorKind::BrokenPipe => PublishError::unavailable(e.to_string()),
            PublishErrorKind::MaxPayloadExceeded => PublishError::too_large(
                m.payload.len(),
                usize::try_from(self_max_payload()).unwrap_or(usize::MAX),
            ),
            _ => PublishError::rejected(e.to_string()),
        }
    }

    async fn publish_batch(&self, batch: &[Message]) -> Vec<Result<(), PublishError>> {
        let timeout_ms = u64::try_from(self.config.ack_timeout.as_millis()).unwrap_or(u64::MAX);
        let mut results = Vec::with_capacity(batch.len());
        for window in batch.chunks(self.config.max_in_flight.max(1)) {
            let mut pending: Vec<Result<PublishAckFuture, PublishError>> =
                Vec::with_capacity(window.len());
            for m in window {
                let sent = self
                    .js
                    .publish_with_headers(
                        m.topic.clone(),
                        Self::headers(m),
                        m.payload.clone().into(),
                    )
                    .await;
                pending.push(sent.map_err(|e| Self::map_error(&e, m, timeout_ms)));
            }
            let deadline = tokio::time::Instant::now() + self.config.ack_timeout;
            for (m, p) in window.iter().zip(pending) {
                let r = match p {
                    Err(e) => Err(e),
                    Ok(ack) => match tokio::time::timeout_at(deadline, ack).await {
                        Ok(Ok(_ack)) => Ok(()),
                        Ok(Err(e)) => Err(Self::map_error(&e, m, timeout_ms)),
                        Err(_) => Err(PublishError::timeout(timeout_ms)),
                    },
                };
                results.push(r);
            }
        }
        results
    }
}

/// NATS's default `max_payload` (1 MiB), reported when the server refuses a message as too
/// large (the client does not tell the limit in the error).
const fn self_max_payload() -> u64 {
    1024 * 1024
}

impl Publisher for NatsPublisher {
    fn publish<'a>(&'a self, batch: &'a [Message]) -> BoxFuture<'a, Vec<Result<(), PublishError>>> {
        Box::pin(self.publish_batch(batch))
    }

    fn name(&self) -> &'static str {
        "nats"
    }
}
