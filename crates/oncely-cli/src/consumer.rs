//! [`ConsumerArgs`]: an inbox consumer's settings.

use std::time::Duration;

use clap::Args;
use oncely_core::RetryPolicy;
use oncely_inbox::ConsumerConfig;
use oncely_runtime::ConsumerSettings;

/// Inbox consumer settings (a service's `serve` and `consume`); the broker comes from
/// [`BrokerArgs`](crate::BrokerArgs) (`--broker`, the relay's).
#[derive(Debug, Args)]
pub struct ConsumerArgs {
    /// Topic the consumer reads (the service's events topic; default `orders`). A
    /// service's `serve` refuses another one ([`ConsumerArgs::refuse_topic_other_than`]):
    /// its in-process consumers read the service's own `--events-topic`.
    #[arg(long, env = "ONCELY_CONSUMER_TOPIC")]
    pub consumer_topic: Option<String>,
    /// Messages handled at once.
    #[arg(long, env = "ONCELY_CONSUMER_CONCURRENCY", default_value_t = 8)]
    consumer_concurrency: usize,
    /// Idle polling interval (SQL transport) / longest wait of one receive, in ms.
    #[arg(long, env = "ONCELY_CONSUMER_POLL_MS", default_value_t = 100)]
    consumer_poll_ms: u64,
    /// Lease on a claimed message (SQL transport) / `ack_wait` (NATS), in seconds: an
    /// unacknowledged message is delivered again after it (must exceed the handler's
    /// longest run). RabbitMQ redelivers when the channel closes instead.
    #[arg(long, env = "ONCELY_CONSUMER_LEASE_SECS", default_value_t = 30)]
    consumer_lease_secs: u64,
    /// Failed handler runs after which a message is dead.
    #[arg(long, env = "ONCELY_CONSUMER_MAX_ATTEMPTS", default_value_t = 10)]
    consumer_max_attempts: u32,
    /// Backoff: upper bound of the first retry's wait, in ms (full jitter, doubling).
    #[arg(long, env = "ONCELY_CONSUMER_BACKOFF_BASE_MS", default_value_t = 500)]
    consumer_backoff_base_ms: u64,
    /// Backoff: upper bound of any wait, in seconds.
    #[arg(long, env = "ONCELY_CONSUMER_BACKOFF_CAP_SECS", default_value_t = 300)]
    consumer_backoff_cap_secs: u64,
    /// How long inbox rows are kept, in seconds; must be longer than the broker's
    /// redelivery window (default 7 days).
    #[arg(long, env = "ONCELY_INBOX_RETENTION_SECS", default_value_t = 604_800)]
    inbox_retention_secs: u64,
}

/// The topic a consumer reads when `--consumer-topic` is not given.
pub const DEFAULT_CONSUMER_TOPIC: &str = "orders";

impl ConsumerArgs {
    /// The topic consumed: `--consumer-topic`, else [`DEFAULT_CONSUMER_TOPIC`].
    pub fn topic(&self) -> &str {
        self.consumer_topic
            .as_deref()
            .unwrap_or(DEFAULT_CONSUMER_TOPIC)
    }

    /// For a command whose consumers read the topic it publishes to (`serve`): a
    /// `--consumer-topic` (or `ONCELY_CONSUMER_TOPIC`) other than `events_topic` would be
    /// ignored, so it is refused at start as a usage error naming both flags (exit status
    /// 2), instead of a service that silently reads another topic than the operator set.
    pub fn refuse_topic_other_than(&self, events_topic: &str) {
        let Some(topic) = self.consumer_topic.as_deref() else {
            return;
        };
        if topic != events_topic {
            let message = format!(
                "--consumer-topic {topic} (or ONCELY_CONSUMER_TOPIC) is not used here: this \
                 command's consumers read the topic it publishes to, --events-topic \
                 {events_topic}. Drop it, or set --events-topic {topic}\n"
            );
            clap::Error::raw(clap::error::ErrorKind::ArgumentConflict, message).exit();
        }
    }

    fn config(&self) -> ConsumerConfig {
        ConsumerConfig {
            concurrency: self.consumer_concurrency.max(1),
            poll: Duration::from_millis(self.consumer_poll_ms.max(1)),
            retry: RetryPolicy {
                base: Duration::from_millis(self.consumer_backoff_base_ms),
                cap: Duration::from_secs(self.consumer_backoff_cap_secs),
                max_attempts: self.consumer_max_attempts.max(1),
                ..RetryPolicy::default()
            },
            inbox_retention: Duration::from_secs(self.inbox_retention_secs),
            ..ConsumerConfig::default()
        }
    }

    /// The settings of consumer group `group` these arguments describe.
    pub fn settings(&self, group: &str) -> ConsumerSettings {
        ConsumerSettings {
            group: group.to_owned(),
            topic: self.topic().to_owned(),
            lease: Duration::from_secs(self.consumer_lease_secs.max(1)),
            consumer: self.config(),
        }
    }
}
