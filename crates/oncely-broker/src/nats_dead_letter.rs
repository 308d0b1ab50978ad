use std::time::Duration;

use async_nats::jetstream::{self, stream::RawMessageErrorKind};
use oncely_core::MessageId;
use tokio::sync::Mutex;

use crate::dead_letter::{dead_letters_impl, preview, Page, REQUEUED_FOR};
use crate::message::headers;
use crate::subscriber::retry_headers;
use crate::{BoxFuture, DeadLetter, DeadLetterError, DeadLetterPosition, Requeue};

/// Settings of [`NatsDeadLetters`].
#[derive(Debug, Clone)]
pub struct NatsDeadLettersConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    /// The DLQ subjects' prefix ([`NatsSubscriberConfig::dlq_prefix`](crate::NatsSubscriberConfig::dlq_prefix)):
    /// group `g`'s dead letters are `<prefix>.g.<subject>`. Default `oncely.dlq`.
    pub dlq_prefix: String,
    /// The stream that captures them. Default `ONCELY_DLQ`.
    pub dlq_stream: String,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
}

impl NatsDeadLettersConfig {
    /// Defaults for the server at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            dlq_prefix: "oncely.dlq".to_owned(),
            dlq_stream: "ONCELY_DLQ".to_owned(),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// `<prefix>.<group>.>`: every dead letter of `group`.
    pub fn group_filter(&self, group: &str) -> String {
        format!("{}.{group}.>", self.dlq_prefix)
    }
}

/// [`DeadLetters`] on NATS JetStream: group `g`'s messages in the DLQ stream, subjects
/// `<dlq_prefix>.g.<subject>`.
///
/// - List: `STREAM.MSG.GET` with `next_by_subj` on `<dlq_prefix>.g.>`, one request per
///   letter, from the sequence after `after` ([`DeadLetterPosition::Nats`]). Dead-lettered
///   at = the DLQ message's own publish time.
/// - Requeue: the message is published (PubAck awaited) to its original subject
///   (`x-oncely-topic`), into the events stream, with its original headers — without the
///   `x-oncely-*` dead-letter headers (attempts: a new stream message is a first
///   delivery), without `Nats-Msg-Id` (the stream's duplicate window would drop it), with
///   `x-oncely-requeued-for: g`. Every group's durable consumer sees that subject; the
///   subscribers of the other groups acknowledge the copy without handing it out
///   ([`NatsSubscriber`](crate::NatsSubscriber)), so only `g` handles it. Then the DLQ
///   message is deleted.
pub struct NatsDeadLetters {
    config: NatsDeadLettersConfig,
    js: Mutex<Option<jetstream::Context>>,
}

impl std::fmt::Debug for NatsDeadLetters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsDeadLetters")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn unavailable(e: &impl std::fmt::Display) -> DeadLetterError {
    DeadLetterError::unavailable(e.to_string())
}

/// The dead-letter headers a requeued copy goes without.
const DEAD_LETTER_HEADERS: [&str; 5] = [
    retry_headers::ATTEMPTS,
    retry_headers::LAST_ERROR,
    retry_headers::CONSUMER,
    retry_headers::TOPIC,
    retry_headers::DEAD_AT,
];

impl NatsDeadLetters {
    /// Dead letters on the server `config` names (connects on the first call).
    pub fn new(config: NatsDeadLettersConfig) -> Self {
        Self {
            config,
            js: Mutex::new(None),
        }
    }

    /// The settings.
    pub fn config(&self) -> &NatsDeadLettersConfig {
        &self.config
    }

    async fn context(&self) -> Result<jetstream::Context, DeadLetterError> {
        let c = &self.config;
        let name = "oncely-dead-letters".to_owned();
        Ok(crate::nats::cached_context(&self.js, &c.url, name, c.connect_timeout).await?)
    }

    /// The DLQ stream, `None` when it does not exist (nothing was ever dead-lettered).
    async fn stream(&self) -> Result<Option<jetstream::stream::Stream>, DeadLetterError> {
        let js = self.context().await?;
        match js.get_stream(&self.config.dlq_stream).await {
            Ok(s) => Ok(Some(s)),
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                jetstream::context::GetStreamErrorKind::Request => Err(unavailable(&e)),
                _ => Err(DeadLetterError::rejected(format!(
                    "stream {}: {e}",
                    self.config.dlq_stream
                ))),
            },
        }
    }

    /// The next message of `group` at or after `seq`, `None` past the last.
    async fn next(
        &self,
        stream: &jetstream::stream::Stream,
        group: &str,
        seq: u64,
    ) -> Result<Option<jetstream::message::StreamMessage>, DeadLetterError> {
        match stream
            .get_first_raw_message_by_subject(self.config.group_filter(group), seq)
            .await
        {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => match e.kind() {
                RawMessageErrorKind::Other => Err(unavailable(&e)),
                _ => Err(DeadLetterError::rejected(format!("DLQ get: {e}"))),
            },
        }
    }

    fn header(m: &jetstream::message::StreamMessage, name: &str) -> Option<String> {
        m.headers.get(name).map(|v| v.as_str().to_owned())
    }

    /// The subject the message was first published to.
    fn original_subject(&self, group: &str, m: &jetstream::message::StreamMessage) -> String {
        Self::header(m, retry_headers::TOPIC).unwrap_or_else(|| {
            let prefix = format!("{}.{group}.", self.config.dlq_prefix);
            m.subject
                .as_str()
                .strip_prefix(&prefix)
                .unwrap_or(m.subject.as_str())
                .to_owned()
        })
    }

    fn decode(&self, group: &str, m: &jetstream::message::StreamMessage) -> DeadLetter {
        DeadLetter {
            position: DeadLetterPosition::Nats(m.sequence),
            message_id: Self::header(m, headers::MESSAGE_ID)
                .and_then(|s| MessageId::parse(&s).ok()),
            topic: self.original_subject(group, m),
            group: group.to_owned(),
            event_type: Self::header(m, headers::EVENT_TYPE).unwrap_or_default(),
            attempts: Self::header(m, retry_headers::ATTEMPTS)
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
            last_error: Self::header(m, retry_headers::LAST_ERROR),
            dead_at_ms: i64::try_from(m.time.unix_timestamp_nanos() / 1_000_000).unwrap_or(0),
            payload_size: m.payload.len(),
            payload_preview: preview(&m.payload),
        }
    }

    async fn page(&self, group: &str, limit: u32, after: Option<&DeadLetterPosition>) -> Page {
        let mut seq = match after {
            None => 1,
            Some(DeadLetterPosition::Nats(s)) => s.saturating_add(1),
            Some(other) => {
                return Err(DeadLetterError::rejected(format!(
                    "position {other} is not a NATS position"
                )))
            }
        };
        let Some(stream) = self.stream().await? else {
            return Ok(Vec::new());
        };
        let mut out = Vec::new();
        while out.len() < limit as usize {
            let Some(m) = self.next(&stream, group, seq).await? else {
                break;
            };
            seq = m.sequence + 1;
            out.push(self.decode(group, &m));
        }
        Ok(out)
    }

    /// Publishes the requeued copy of `m` for `group` and awaits its PubAck.
    async fn republish(
        &self,
        group: &str,
        m: &jetstream::message::StreamMessage,
    ) -> Result<(), DeadLetterError> {
        let js = self.context().await?;
        let mut h = async_nats::HeaderMap::new();
        for (k, vs) in m.headers.iter() {
            let name = k.to_string();
            let dropped = DEAD_LETTER_HEADERS
                .iter()
                .any(|d| d.eq_ignore_ascii_case(&name))
                || name.eq_ignore_ascii_case(async_nats::header::NATS_MESSAGE_ID.as_ref())
                || name.eq_ignore_ascii_case(REQUEUED_FOR);
            if let (false, Some(v)) = (dropped, vs.last()) {
                h.insert(name.as_str(), v.as_str());
            }
        }
        h.insert(REQUEUED_FOR, group);
        let subject = self.original_subject(group, m);
        js.publish_with_headers(subject.clone(), h, m.payload.clone())
            .await
            .map_err(|e| unavailable(&e))?
            .await
            .map_err(|e| DeadLetterError::rejected(format!("requeue to {subject}: {e}")))?;
        Ok(())
    }

    async fn requeue_selected(&self, group: &str, which: Requeue) -> Result<u64, DeadLetterError> {
        let Some(stream) = self.stream().await? else {
            return Ok(0);
        };
        let (mut seq, mut n) = (1, 0);
        while let Some(m) = self.next(&stream, group, seq).await? {
            seq = m.sequence + 1;
            let id = Self::header(&m, headers::MESSAGE_ID).and_then(|s| MessageId::parse(&s).ok());
            if !which.selects(id.as_ref()) {
                continue;
            }
            // Requeue first, then remove: dying in between leaves a duplicate.
            self.republish(group, &m).await?;
            stream
                .delete_message(m.sequence)
                .await
                .map_err(|e| unavailable(&e))?;
            n += 1;
        }
        Ok(n)
    }
}

dead_letters_impl!(NatsDeadLetters, "nats" {
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {
            if let Some(js) = self.js.lock().await.take() {
                drop(js.client().drain().await);
            }
        })
    }
});
