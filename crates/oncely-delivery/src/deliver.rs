use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, HeaderValue};
use oncely_broker::{headers, BoxFuture, ReceivedMessage, Subscriber};
use oncely_core::RetryPolicy;
use oncely_inbox::{Consumer, ConsumerConfig, Handler, HandlerError, Rejected};
use oncely_sql::{Database, Tx};

use crate::answer::{preview, retry_after, Verdict, BODY_PREVIEW_BYTES};
use crate::signing::{SigningSecret, WEBHOOK_ID, WEBHOOK_SIGNATURE, WEBHOOK_TIMESTAMP};

/// The message headers a delivery forwards under their own names, when the message has
/// them (besides `event-type` and `partition-key`, which every message has).
const FORWARDED: [&str; 3] = [headers::CORRELATION_ID, headers::TRACEPARENT, "tenant"];

/// The `content-type` of a message that names none: oncely's events are JSON.
const DEFAULT_CONTENT_TYPE: &str = "application/json";

/// Where and how a [`DeliveryHandler`] delivers.
#[derive(Debug, Clone)]
pub struct DeliveryConfig {
    /// The endpoint each message is POSTed to (`http` or `https`).
    pub url: reqwest::Url,
    /// The endpoint's Standard Webhooks secret.
    pub secret: SigningSecret,
    /// The longest one attempt may take, connect to last body byte. Default 10 s.
    pub timeout: Duration,
    /// The longest `Retry-After` (of a 429 or 503) waited for before the attempt returns
    /// to the consumer's backoff. Default 10 s. With [`DeliveryConfig::timeout`] it bounds
    /// a handler run, which must stay below the consumer's lease
    /// ([`DeliveryConfig::longest_attempt`]).
    pub retry_after_ceiling: Duration,
}

impl DeliveryConfig {
    /// Delivery to `url` signed with `secret`, the other settings at their defaults.
    pub fn new(url: reqwest::Url, secret: SigningSecret) -> Self {
        Self {
            url,
            secret,
            timeout: Duration::from_secs(10),
            retry_after_ceiling: Duration::from_secs(10),
        }
    }

    /// The longest one handler run can take: the request's timeout and the longest
    /// `Retry-After` waited for. The consumer's lease (SQL transport) / `ack_wait` (NATS)
    /// must exceed it, or a message in hand is delivered a second time meanwhile.
    pub fn longest_attempt(&self) -> Duration {
        self.timeout.saturating_add(self.retry_after_ceiling)
    }
}

/// The receiver could not be asked or did not take the message, and the message is not
/// to blame ([`Verdict::Unavailable`]): the consumer retries it after its backoff, without
/// end (see [`Delivery`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// The receiver answered a status that does not refuse the message (5xx, 408, 429,
    /// 1xx, 3xx — redirects are not followed).
    #[error("receiver unavailable: HTTP {status}: {body}")]
    Status {
        /// The status.
        status: u16,
        /// The first 200 bytes of the answer's body.
        body: String,
    },
    /// No answer: a timeout, a refused connection, a connection closed before the answer.
    #[error("receiver unavailable: {0}")]
    NoAnswer(#[source] reqwest::Error),
}

/// The client could not be built.
#[derive(Debug, thiserror::Error)]
#[error("cannot build the HTTP client: {0}")]
pub struct ClientError(#[source] reqwest::Error);

/// An inbox [`Handler`] that POSTs each message to one endpoint, signed as Standard
/// Webhooks (`webhook-id` = the message id, stable across redeliveries, so the receiver
/// deduplicates on it), and judges the answer by [`Verdict::of_status`]: 2xx is `Ok` (the
/// inbox row commits, the delivery is acknowledged), a refusal is a [`Rejected`] error (dead
/// at once, the answer as the reason), anything else an [`Unavailable`] error.
///
/// The request carries the message's body as is, its `content-type` (default
/// `application/json`), `webhook-id`, `webhook-timestamp` (Unix seconds of this attempt),
/// `webhook-signature` (`v1,…`, [`SigningSecret::sign`]) and the message headers
/// `event-type`, `partition-key`, `correlation-id`, `traceparent` and `tenant` under their
/// own names. Redirects are not followed.
#[derive(Debug)]
pub struct DeliveryHandler {
    client: reqwest::Client,
    config: DeliveryConfig,
}

impl DeliveryHandler {
    /// A handler delivering per `config`.
    ///
    /// # Errors
    /// [`ClientError`] when the HTTP client cannot be built (no TLS backend, say).
    pub fn new(config: DeliveryConfig) -> Result<Self, ClientError> {
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .timeout(config.timeout)
            .build()
            .map_err(ClientError)?;
        Ok(Self { client, config })
    }

    /// The headers of one attempt of `message` at `timestamp` (Unix seconds).
    fn headers(&self, message: &ReceivedMessage, timestamp: i64) -> http::HeaderMap {
        let id = message.id.to_string();
        let signature = self.config.secret.sign(&id, timestamp, &message.payload);
        let content_type = message
            .headers
            .get("content-type")
            .map_or(DEFAULT_CONTENT_TYPE, String::as_str);
        let mut pairs: Vec<(&'static str, &str)> = vec![
            ("content-type", content_type),
            (WEBHOOK_ID, &id),
            (headers::EVENT_TYPE, &message.event_type),
            (headers::PARTITION_KEY, &message.partition_key),
        ];
        for name in FORWARDED {
            if let Some(v) = message.headers.get(name) {
                pairs.push((name, v));
            }
        }
        let timestamp = timestamp.to_string();
        pairs.extend([
            (WEBHOOK_TIMESTAMP, timestamp.as_str()),
            (WEBHOOK_SIGNATURE, signature.as_str()),
        ]);
        let mut map = http::HeaderMap::new();
        for (name, value) in pairs {
            match HeaderValue::from_str(value) {
                Ok(v) => {
                    map.insert(HeaderName::from_static(name), v);
                }
                // A value no HTTP header can carry (a line break) is left out, not sent
                // mangled.
                Err(_) => {
                    tracing::debug!(message_id = %id, header = name, "not a header value; left out");
                }
            }
        }
        map
    }

    /// One attempt of `message`.
    ///
    /// # Errors
    /// [`Rejected`] for a refusal, [`Unavailable`] otherwise (after waiting out a
    /// `Retry-After` up to [`DeliveryConfig::retry_after_ceiling`]).
    pub async fn deliver(&self, message: &ReceivedMessage) -> Result<(), HandlerError> {
        let timestamp = oncely_core::now_ms().div_euclid(1000);
        let sent = self
            .client
            .post(self.config.url.clone())
            .headers(self.headers(message, timestamp))
            .body(message.payload.clone())
            .send()
            .await;
        let mut response = sent.map_err(Unavailable::NoAnswer)?;
        let status = response.status();
        let verdict = Verdict::of_status(status.as_u16());
        if verdict == Verdict::Delivered {
            tracing::debug!(message_id = %message.id, status = status.as_u16(), "delivered");
            return Ok(());
        }
        let wait = retry_after(response.headers());
        let mut body = Vec::new();
        // The preview only: an answer that breaks off mid-body still has its status.
        while body.len() < BODY_PREVIEW_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => body.extend_from_slice(&chunk),
                Ok(None) | Err(_) => break,
            }
        }
        let body = preview(&body);
        if verdict == Verdict::Refused {
            return Err(Box::new(Rejected(format!("HTTP {status}: {body}"))));
        }
        if let Some(wait) = wait {
            tokio::time::sleep(wait.min(self.config.retry_after_ceiling)).await;
        }
        Err(Box::new(Unavailable::Status {
            status: status.as_u16(),
            body,
        }))
    }
}

impl Handler for DeliveryHandler {
    /// Delivers `message` ([`DeliveryHandler::deliver`]); writes nothing through `tx`, whose
    /// commit records the message in the inbox once the receiver has it.
    fn handle<'a>(
        &'a self,
        _tx: &'a mut Tx,
        message: &'a ReceivedMessage,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(self.deliver(message))
    }
}

/// The [`oncely_runtime::ConsumerFactory`] of a delivery consumer: a [`Consumer`] of any
/// broker whose handler is a [`DeliveryHandler`] and whose retry policy never gives up
/// ([`Delivery::retry_policy`]).
#[derive(Debug, Clone)]
pub struct Delivery {
    handler: Arc<DeliveryHandler>,
}

impl Delivery {
    /// Delivery through `handler`.
    pub fn new(handler: DeliveryHandler) -> Self {
        Self {
            handler: Arc::new(handler),
        }
    }

    /// `retry` as a delivery consumer runs it: its backoff (base, cap, full jitter,
    /// [`RetryPolicy::decide`]) without an attempt limit or deadline. The handler fails
    /// only when the receiver is unavailable (or the database errs), and that is never the
    /// message's defect; a refusal is [`Rejected`] and dead at once, whatever the policy.
    pub fn retry_policy(retry: RetryPolicy) -> RetryPolicy {
        RetryPolicy {
            max_attempts: u32::MAX,
            deadline: None,
            ..retry
        }
    }
}

impl oncely_runtime::ConsumerFactory for Delivery {
    fn build<S: Subscriber>(
        &self,
        db: &Database,
        subscriber: S,
        mut config: ConsumerConfig,
    ) -> Consumer<S> {
        config.retry = Self::retry_policy(config.retry);
        Consumer::new(db.clone(), subscriber, self.handler.clone(), config)
    }
}
