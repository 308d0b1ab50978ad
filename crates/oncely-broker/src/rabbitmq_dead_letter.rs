use std::time::Duration;

use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use oncely_core::MessageId;

use crate::dead_letter::{dead_letters_impl, preview, Page};
use crate::message::headers;
use crate::rabbitmq_subscriber::{long, publish_to_queue, value_str};
use crate::subscriber::retry_headers;
use crate::{DeadLetter, DeadLetterError, DeadLetterPosition, Requeue};

/// Settings of [`RabbitMqDeadLetters`].
#[derive(Debug, Clone)]
pub struct RabbitMqDeadLettersConfig {
    /// AMQP URL, e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub url: String,
    /// The groups' queue prefix (as [`RabbitMqSubscriberConfig::with_queue_prefix`](crate::RabbitMqSubscriberConfig::with_queue_prefix)):
    /// group `g` reads `<prefix>.g` and dead-letters to `<prefix>.g.dead`. Default `oncely`.
    pub queue_prefix: String,
    /// How long a requeued copy may wait for its publisher confirm. Default 10 s.
    pub confirm_timeout: Duration,
    /// Connection establishment timeout. Default 5 s.
    pub connect_timeout: Duration,
}

impl RabbitMqDeadLettersConfig {
    /// Defaults for the broker at `url`.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            queue_prefix: "oncely".to_owned(),
            confirm_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
        }
    }

    /// Group `group`'s queue, `<prefix>.<group>`.
    pub fn queue(&self, group: &str) -> String {
        format!("{}.{group}", self.queue_prefix)
    }

    /// Group `group`'s dead queue, `<prefix>.<group>.dead`.
    pub fn dead_queue(&self, group: &str) -> String {
        format!("{}.{group}.dead", self.queue_prefix)
    }
}

/// [`DeadLetters`] on RabbitMQ: a group's dead queue `<prefix>.<group>.dead`.
///
/// - List: `basic.get` without auto-ack, up to the page's end, then the connection closes
///   and the broker puts every message back in its place. Positions are indexes in the
///   queue ([`DeadLetterPosition::Amqp`]).
/// - Requeue: each selected message is published (mandatory, confirm awaited) through the
///   default exchange to the group's queue `<prefix>.<group>` — that group only, never the
///   fan-out exchange — without `x-oncely-attempts` (attempts reset), `x-oncely-last-error`,
///   `x-oncely-consumer`, `x-oncely-dead-at` and the broker's `x-death` headers, keeping
///   `x-oncely-topic`; then the dead copy is acknowledged (removed). Others go back
///   untouched when the connection closes.
///
/// One connection per call (operator actions are rare; nothing to keep alive).
#[derive(Debug, Clone)]
pub struct RabbitMqDeadLetters {
    config: RabbitMqDeadLettersConfig,
}

fn unavailable(e: &lapin::Error) -> DeadLetterError {
    DeadLetterError::unavailable(e.to_string())
}

/// A `basic.get` message decoded, with the properties and body a requeue copies.
struct Got {
    letter: DeadLetter,
    delivery: lapin::message::Delivery,
}

impl RabbitMqDeadLetters {
    /// Dead letters on the broker `config` names (connects on each call).
    pub fn new(config: RabbitMqDeadLettersConfig) -> Self {
        Self { config }
    }

    /// The settings.
    pub fn config(&self) -> &RabbitMqDeadLettersConfig {
        &self.config
    }

    async fn connect(&self) -> Result<(Connection, Channel), DeadLetterError> {
        Ok(crate::rabbitmq::connect_channel(
            &self.config.url,
            "oncely-dead-letters".to_owned(),
            self.config.connect_timeout,
        )
        .await?)
    }

    /// Whether the dead queue exists (a passive declare; a group that never subscribed has
    /// none). A passive declare of a missing queue closes its channel, so it gets its own.
    async fn dead_queue_exists(
        connection: &Connection,
        queue: &str,
    ) -> Result<bool, DeadLetterError> {
        let probe = connection
            .create_channel()
            .await
            .map_err(|e| unavailable(&e))?;
        let declared = probe
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await;
        match declared {
            Ok(_) => {
                drop(probe.close(200, "probed").await);
                Ok(true)
            }
            Err(e) => match e.kind() {
                lapin::ErrorKind::ProtocolError(p) if p.get_id() == 404 => Ok(false),
                _ => Err(unavailable(&e)),
            },
        }
    }

    fn decode(group: &str, index: u64, delivery: lapin::message::Delivery) -> Got {
        let props = &delivery.properties;
        let hdrs: std::collections::BTreeMap<String, String> = props
            .headers()
            .as_ref()
            .map(|t| {
                t.into_iter()
                    .filter_map(|(k, v)| value_str(v).map(|v| (k.as_str().to_owned(), v)))
                    .collect()
            })
            .unwrap_or_default();
        let message_id = props
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_owned())
            .or_else(|| hdrs.get(headers::MESSAGE_ID).cloned())
            .and_then(|s| MessageId::parse(&s).ok());
        let letter = DeadLetter {
            position: DeadLetterPosition::Amqp(index),
            message_id,
            topic: hdrs
                .get(retry_headers::TOPIC)
                .cloned()
                .unwrap_or_else(|| delivery.routing_key.as_str().to_owned()),
            group: hdrs
                .get(retry_headers::CONSUMER)
                .cloned()
                .unwrap_or_else(|| group.to_owned()),
            event_type: hdrs
                .get(headers::EVENT_TYPE)
                .cloned()
                .or_else(|| props.kind().as_ref().map(|k| k.as_str().to_owned()))
                .unwrap_or_default(),
            attempts: hdrs
                .get(retry_headers::ATTEMPTS)
                .and_then(|a| a.parse().ok())
                .unwrap_or(0),
            last_error: hdrs.get(retry_headers::LAST_ERROR).cloned(),
            dead_at_ms: hdrs
                .get(retry_headers::DEAD_AT)
                .and_then(|t| t.parse().ok())
                .unwrap_or(0),
            payload_size: delivery.data.len(),
            payload_preview: preview(&delivery.data),
        };
        Got { letter, delivery }
    }

    async fn get(
        channel: &Channel,
        queue: &str,
        group: &str,
        index: u64,
    ) -> Result<Option<Got>, DeadLetterError> {
        Ok(channel
            .basic_get(queue, BasicGetOptions { no_ack: false })
            .await
            .map_err(|e| unavailable(&e))?
            .map(|m| Self::decode(group, index, m.delivery)))
    }

    async fn page(&self, group: &str, limit: u32, after: Option<&DeadLetterPosition>) -> Page {
        let skip = match after {
            None => 0,
            Some(DeadLetterPosition::Amqp(i)) => i.saturating_add(1),
            Some(other) => {
                return Err(DeadLetterError::rejected(format!(
                    "position {other} is not a RabbitMQ position"
                )))
            }
        };
        let queue = self.config.dead_queue(group);
        let (connection, channel) = self.connect().await?;
        let mut out = Vec::new();
        if Self::dead_queue_exists(&connection, &queue).await? {
            let mut index = 0;
            while out.len() < limit as usize {
                let Some(got) = Self::get(&channel, &queue, group, index).await? else {
                    break;
                };
                if index >= skip {
                    out.push(got.letter);
                }
                index += 1;
            }
        }
        // Closing hands every unacknowledged message back to the queue, in its place.
        drop(connection.close(200, "listed").await);
        Ok(out)
    }

    /// The properties of the copy that goes back to the group: the dead letter's, without
    /// the dead-letter headers (attempts reset), with the original topic.
    fn requeue_properties(got: &Got) -> BasicProperties {
        let original = got
            .delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default();
        let mut kept = FieldTable::default();
        for (k, v) in original.inner() {
            let name = k.as_str();
            let dropped = [
                retry_headers::ATTEMPTS,
                retry_headers::LAST_ERROR,
                retry_headers::CONSUMER,
                retry_headers::DEAD_AT,
                "x-death",
            ]
            .contains(&name)
                || name.starts_with("x-first-death-")
                || name.starts_with("x-last-death-");
            if !dropped {
                kept.insert(k.clone(), v.clone());
            }
        }
        kept.insert(retry_headers::TOPIC.into(), long(&got.letter.topic));
        got.delivery
            .properties
            .clone()
            .with_headers(kept)
            .with_delivery_mode(2)
    }

    async fn copy_to(
        &self,
        publish: &Channel,
        queue: &str,
        got: &Got,
    ) -> Result<(), DeadLetterError> {
        let props = Self::requeue_properties(got);
        let timeout = self.config.confirm_timeout;
        publish_to_queue(publish, queue, &got.delivery.data, props, timeout)
            .await
            .into_result("requeue", queue)
    }

    async fn requeue_selected(&self, group: &str, which: Requeue) -> Result<u64, DeadLetterError> {
        let (dead, target) = (self.config.dead_queue(group), self.config.queue(group));
        let (connection, channel) = self.connect().await?;
        let result = async {
            if !Self::dead_queue_exists(&connection, &dead).await? {
                return Ok(0);
            }
            let publish = crate::rabbitmq::confirm_channel(&connection)
                .await
                .map_err(|e| unavailable(&e))?;
            let mut n = 0;
            let mut index = 0;
            // Messages not acknowledged are not handed out again on this channel, so the
            // scan ends when every one has been seen once.
            while let Some(got) = Self::get(&channel, &dead, group, index).await? {
                index += 1;
                if !which.selects(got.letter.message_id.as_ref()) {
                    continue;
                }
                // Requeue first, then remove: dying in between leaves a duplicate.
                self.copy_to(&publish, &target, &got).await?;
                got.delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(|e| unavailable(&e))?;
                n += 1;
            }
            Ok(n)
        }
        .await;
        // The ones not selected go back to the dead queue.
        drop(connection.close(200, "requeued").await);
        result
    }
}

dead_letters_impl!(RabbitMqDeadLetters, "rabbitmq" {});
