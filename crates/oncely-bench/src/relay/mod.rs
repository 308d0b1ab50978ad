//! `oncely-bench relay`: relay throughput against the raw broker client with the same
//! confirmation mode, and commit-to-publish latency at a steady event rate.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Args;
use oncely_broker::{
    KafkaConfig, KafkaPublisher, NatsConfig, NatsPublisher, Publisher, RabbitMqConfig,
    RabbitMqPublisher,
};
use oncely_core::MessageId;
use oncely_outbox::{Relay, RelayConfig};
use oncely_sql::{Database, DbOptions, OutboxEvent, OutboxStore};
use oncely_testkit::TestDb;
use tokio_util::sync::CancellationToken;

use crate::stats::{median, quantile};

mod stages;

use stages::{Clock, Stages, Stamped, Written};

/// Where each broker listens: the flags of `relay` and `chain`.
#[derive(Debug, Args)]
pub(crate) struct BrokerUrls {
    /// RabbitMQ URL.
    #[arg(
        long,
        env = "ONCELY_TEST_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub(crate) amqp_url: String,
    /// NATS URL.
    #[arg(
        long,
        env = "ONCELY_TEST_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub(crate) nats_url: String,
    /// Kafka bootstrap servers.
    #[arg(
        long,
        env = "ONCELY_TEST_KAFKA_BROKERS",
        default_value = "127.0.0.1:9092"
    )]
    pub(crate) kafka_brokers: String,
}

#[derive(Debug, Args)]
pub(crate) struct RelayBenchArgs {
    /// Database holding the outbox; a fresh schema (PostgreSQL) or file (SQLite) is used.
    #[arg(
        long,
        env = "ONCELY_TEST_POSTGRES_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
    #[command(flatten)]
    pub(crate) urls: BrokerUrls,
    /// Events per throughput run (relay and raw client each).
    #[arg(long, default_value_t = 20_000)]
    events: usize,
    /// Confirmation window: messages in flight before waiting for their confirmations
    /// (the relay's batch size and the raw client's window).
    #[arg(long, default_value_t = 256)]
    window: usize,
    /// Steady rate of the latency run, events/s (one transaction per event).
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of the latency run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Brokers to measure.
    #[arg(long, value_delimiter = ',', default_value = "rabbitmq,nats,kafka")]
    brokers: Vec<String>,
    /// Batches in flight in the latency run (default: the relay's default).
    #[arg(long)]
    latency_in_flight_batches: Option<usize>,
    /// Throughput rounds per broker, each a raw-client run then a relay run (fresh
    /// outbox); the figures printed are the medians, so one disturbed run does not decide.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Batches in flight in the throughput run; each batch is `window / this` rows, so at
    /// most `window` messages await confirmation, as with the raw client.
    #[arg(long, default_value_t = 2)]
    in_flight_batches: usize,
    /// The relay's retention of published rows in the throughput run, seconds (default:
    /// the relay's default, 0 — none kept; see `RelayConfig::retention`). The latency run
    /// always keeps them, to read their publish times.
    #[arg(long)]
    retention_secs: Option<u64>,
    /// The relay's `vacuum_after_rows` in the throughput run (default: the relay's default;
    /// 0 leaves the outbox to autovacuum, so dead entries pile up from round to round).
    #[arg(long)]
    vacuum_after_rows: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    RabbitMq,
    Nats,
    Kafka,
}

impl Broker {
    fn name(self) -> &'static str {
        match self {
            Self::RabbitMq => "rabbitmq",
            Self::Nats => "nats",
            Self::Kafka => "kafka",
        }
    }
}

/// A destination created for one run (queue / stream), removed at the end.
struct Target {
    broker: Broker,
    topic: String,
    publisher: Arc<dyn Publisher>,
    /// Connection, channel, queue, and the channel of the consumer draining the queue.
    amqp: Option<(lapin::Connection, lapin::Channel, String, lapin::Channel)>,
    nats: Option<(NatsPublisher, String)>,
    /// The raw producer, with the relay's producer settings; created once and reused, so
    /// its start-up (connect, InitProducerId) falls into the warm-up, as the relay's does.
    kafka: Option<rdkafka::producer::FutureProducer>,
}

const EXCHANGE: &str = "oncely.bench";

fn payload(n: usize) -> Vec<u8> {
    // About the size of an order.created body.
    serde_json::json!({
        "id": format!("0190b7a2-5f3c-7e11-a1b2-{n:012}"), "status": "created",
        "source": "bench", "external_ref": format!("bench-{n}"), "customer_id": "c-42",
        "items": [{"sku": "sku-1", "quantity": 2}, {"sku": "sku-2", "quantity": 1}],
        "amount_minor": 1999, "currency": "EUR", "created_at": 1_767_225_600_000_i64
    })
    .to_string()
    .into_bytes()
}

async fn amqp_connect(url: &str) -> anyhow::Result<(lapin::Connection, lapin::Channel)> {
    let conn = lapin::Connection::connect(url, oncely_broker::amqp_connection_properties()).await?;
    let ch = conn.create_channel().await?;
    Ok((conn, ch))
}

/// Publishes `m` with the raw lapin client exactly as [`RabbitMqPublisher`] does (same
/// exchange, routing key = topic, `mandatory`, same properties); returns its confirm.
async fn amqp_publish(
    ch: &lapin::Channel,
    m: &oncely_broker::Message,
) -> anyhow::Result<lapin::publisher_confirm::PublisherConfirm> {
    Ok(ch
        .basic_publish(
            EXCHANGE,
            m.topic.as_str(),
            lapin::options::BasicPublishOptions {
                mandatory: true,
                ..lapin::options::BasicPublishOptions::default()
            },
            &m.payload,
            RabbitMqPublisher::properties(m),
        )
        .await?)
}

impl Target {
    async fn new(broker: Broker, args: &RelayBenchArgs, window: usize) -> anyhow::Result<Self> {
        use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
        use lapin::types::FieldTable;
        let topic = format!("bench{}", uuid::Uuid::new_v4().simple());
        match broker {
            Broker::RabbitMq => {
                let (conn, ch) = amqp_connect(&args.urls.amqp_url)
                    .await
                    .context("connecting to RabbitMQ")?;
                ch.exchange_declare(
                    EXCHANGE,
                    lapin::ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
                // A durable queue, so persistent messages are written as in production.
                ch.queue_declare(
                    topic.as_str(),
                    QueueDeclareOptions {
                        durable: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await?;
                ch.queue_bind(
                    topic.as_str(),
                    EXCHANGE,
                    topic.as_str(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
                // A consumer drains the queue throughout, as in production: a queue that
                // only grows (tens of thousands of messages held by the queue process)
                // stalls the broker's confirms in long garbage collections, which would
                // measure the unconsumed queue rather than the publishers.
                let consumer_channel = conn.create_channel().await?;
                let mut deliveries = consumer_channel
                    .basic_consume(
                        topic.as_str(),
                        "oncely-bench-drain",
                        lapin::options::BasicConsumeOptions {
                            no_ack: true,
                            ..lapin::options::BasicConsumeOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await?;
                tokio::spawn(async move {
                    use futures_util::StreamExt as _;
                    while let Some(Ok(_)) = deliveries.next().await {}
                });
                let mut c = RabbitMqConfig::new(&args.urls.amqp_url);
                EXCHANGE.clone_into(&mut c.exchange);
                c.max_in_flight = window;
                let publisher = Arc::new(RabbitMqPublisher::connect(c).await?);
                Ok(Self {
                    broker,
                    topic: topic.clone(),
                    publisher,
                    amqp: Some((conn, ch, topic, consumer_channel)),
                    nats: None,
                    kafka: None,
                })
            }
            Broker::Nats => {
                let mut c = NatsConfig::new(&args.urls.nats_url);
                c.max_in_flight = window;
                let p = NatsPublisher::connect(c)
                    .await
                    .context("connecting to NATS")?;
                let stream = format!("BENCH{}", uuid::Uuid::new_v4().simple());
                p.ensure_stream(&stream, std::slice::from_ref(&topic))
                    .await?;
                Ok(Self {
                    broker,
                    topic,
                    publisher: Arc::new(p.clone()),
                    amqp: None,
                    nats: Some((p, stream)),
                    kafka: None,
                })
            }
            Broker::Kafka => {
                oncely_broker::ensure_topic(&args.urls.kafka_brokers, &topic, 3)
                    .await
                    .context("creating the Kafka topic")?;
                let c = KafkaConfig::new(&args.urls.kafka_brokers);
                let p = KafkaPublisher::new(c.clone())?;
                Ok(Self {
                    broker,
                    topic,
                    publisher: Arc::new(p),
                    amqp: None,
                    nats: None,
                    kafka: Some(c.producer_config().create()?),
                })
            }
        }
    }

    /// The raw client: the same messages, persistent / with a message id, published in
    /// windows of `window` whose confirmations (AMQP confirms / JetStream PubAcks / Kafka
    /// delivery reports of the idempotent producer with `acks=all`, the relay's producer
    /// settings) are awaited together — the relay's confirmation mode. Returns messages/s.
    async fn raw(&self, args: &RelayBenchArgs, n: usize, window: usize) -> anyhow::Result<f64> {
        use lapin::options::ConfirmSelectOptions;
        let started = Instant::now();
        match self.broker {
            Broker::RabbitMq => {
                let (_conn, ch) = amqp_connect(&args.urls.amqp_url).await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                let mut i = 0;
                while i < n {
                    // The whole window's publishes at once (each resolves when lapin's io
                    // thread has written it), then its confirmations.
                    let messages: Vec<_> = (i..(i + window).min(n))
                        .map(|k| message(&self.topic, k))
                        .collect();
                    let confirms = futures_util::future::join_all(
                        messages.iter().map(|m| amqp_publish(&ch, m)),
                    )
                    .await;
                    i += confirms.len();
                    for c in confirms {
                        anyhow::ensure!(
                            matches!(c?.await?, lapin::publisher_confirm::Confirmation::Ack(None)),
                            "raw publish not acknowledged"
                        );
                    }
                }
            }
            Broker::Nats => {
                let (publisher, _) = self.nats.as_ref().expect("nats target");
                let js = publisher.jetstream();
                let mut i = 0;
                while i < n {
                    let mut acks = Vec::with_capacity(window);
                    for k in i..(i + window).min(n) {
                        let m = message(&self.topic, k);
                        let h = NatsPublisher::headers(&m);
                        acks.push(
                            js.publish_with_headers(m.topic.clone(), h, m.payload.into())
                                .await?,
                        );
                    }
                    i += acks.len();
                    for a in acks {
                        a.await?;
                    }
                }
            }
            Broker::Kafka => {
                let producer = self.raw_kafka_producer()?;
                let mut i = 0;
                while i < n {
                    let mut reports = Vec::with_capacity(window);
                    for k in i..(i + window).min(n) {
                        let m = message(&self.topic, k);
                        reports.push(
                            producer
                                .send_result(KafkaPublisher::record(&m))
                                .map_err(|(e, _)| anyhow::anyhow!("enqueue: {e}"))?,
                        );
                    }
                    i += reports.len();
                    for r in reports {
                        r.await?
                            .map_err(|(e, _)| anyhow::anyhow!("delivery: {e}"))?;
                    }
                }
            }
        }
        Ok(n as f64 / started.elapsed().as_secs_f64())
    }

    /// The raw rdkafka producer with the relay's settings (idempotence, `acks=all`, linger).
    fn raw_kafka_producer(&self) -> anyhow::Result<rdkafka::producer::FutureProducer> {
        self.kafka.clone().context("kafka target")
    }

    /// The raw client's own publish-to-confirmation latency at `rate`/s for `secs` (one
    /// message at a time, each confirmation awaited on its own): the broker's floor for the
    /// relay's commit-to-publish latency. Returns sorted ms.
    async fn raw_latency(
        &self,
        args: &RelayBenchArgs,
        rate: u64,
        secs: u64,
    ) -> anyhow::Result<Vec<i64>> {
        use lapin::options::ConfirmSelectOptions;
        let total = rate * secs;
        let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate as f64));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let mut waits = Vec::with_capacity(total as usize);
        let amqp = match self.broker {
            Broker::RabbitMq => {
                let (conn, ch) = amqp_connect(&args.urls.amqp_url).await?;
                ch.confirm_select(ConfirmSelectOptions::default()).await?;
                Some((conn, ch))
            }
            Broker::Nats | Broker::Kafka => None,
        };
        let kafka = match self.broker {
            Broker::Kafka => Some(self.raw_kafka_producer()?),
            _ => None,
        };
        for k in 0..total as usize {
            tick.tick().await;
            let started = Instant::now();
            // The very message the relay would publish for this event.
            let m = message(&self.topic, k);
            let wait: tokio::task::JoinHandle<anyhow::Result<i64>> = match (&amqp, &self.nats) {
                _ if kafka.is_some() => {
                    let producer = kafka.as_ref().expect("checked");
                    let report = producer
                        .send_result(KafkaPublisher::record(&m))
                        .map_err(|(e, _)| anyhow::anyhow!("enqueue: {e}"))?;
                    tokio::spawn(async move {
                        report
                            .await?
                            .map_err(|(e, _)| anyhow::anyhow!("delivery: {e}"))?;
                        Ok(oncely_core::millis(started.elapsed()))
                    })
                }
                (Some((_, ch)), _) => {
                    let confirm = amqp_publish(ch, &m).await?;
                    tokio::spawn(async move {
                        confirm.await?;
                        Ok(oncely_core::millis(started.elapsed()))
                    })
                }
                (None, Some((p, _))) => {
                    let h = NatsPublisher::headers(&m);
                    let ack = p
                        .jetstream()
                        .publish_with_headers(m.topic.clone(), h, m.payload.into())
                        .await?;
                    tokio::spawn(async move {
                        ack.await?;
                        Ok(oncely_core::millis(started.elapsed()))
                    })
                }
                _ => anyhow::bail!("no client"),
            };
            waits.push(wait);
        }
        let mut lat = Vec::with_capacity(waits.len());
        for w in waits {
            lat.push(w.await??);
        }
        lat.sort_unstable();
        Ok(lat)
    }

    async fn cleanup(self) {
        self.publisher.close().await;
        if let Some((conn, ch, queue, consumer_channel)) = self.amqp {
            drop(
                consumer_channel
                    .basic_cancel(
                        "oncely-bench-drain",
                        lapin::options::BasicCancelOptions::default(),
                    )
                    .await,
            );
            drop(consumer_channel.close(0, "bench done").await);
            drop(
                ch.queue_delete(
                    queue.as_str(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await,
            );
            drop(conn.close(0, "bench done").await);
        }
        if let Some((p, stream)) = self.nats {
            drop(p.jetstream().delete_stream(&stream).await);
        }
        // Kafka: the bench topic stays (tansu keeps it in memory; a real cluster's retention
        // removes the records).
    }
}

/// The message the relay publishes for [`event`]`(topic, n)` (fresh id): the raw client
/// sends exactly these, headers included.
fn message(topic: &str, n: usize) -> oncely_broker::Message {
    oncely_outbox::to_message(event(topic, n))
}

fn event(topic: &str, n: usize) -> OutboxEvent {
    OutboxEvent::new(
        MessageId::new_random(),
        topic,
        format!("agg-{n}"),
        "order.created",
        payload(n),
    )
    // The headers the order service sends with `order.created`.
    .with_header("correlation-id", format!("bench-{n}"))
    .with_header("idempotency-key", format!("bench-key-{n}"))
    .with_header(
        "traceparent",
        format!("00-{:032x}-{:016x}-01", n + 1, n + 1),
    )
    .with_header("tenant", "bench")
}

/// Relay throughput: `args.events` events committed first, then one relay drains them
/// ([`Relay::drain`]: claim → publish with confirms → settle, pipelined,
/// `args.in_flight_batches` batches of `window / in_flight_batches` rows in flight).
/// Returns events/s.
async fn relay_throughput(
    db: &Database,
    target: &Target,
    args: &RelayBenchArgs,
) -> anyhow::Result<f64> {
    let (n, window) = (args.events, args.window);
    let batches = args.in_flight_batches.clamp(1, window.max(1));
    for chunk in (0..n).collect::<Vec<_>>().chunks(500) {
        let mut tx = db.begin().await?;
        for &k in chunk {
            OutboxStore::enqueue(&mut tx, &event(&target.topic, k)).await?;
        }
        tx.commit().await?;
    }
    // At most `window` messages await confirmation, as with the raw client.
    let relay = Relay::new(
        db.clone(),
        target.publisher.clone(),
        RelayConfig {
            batch_size: u32::try_from(window / batches).unwrap_or(u32::MAX).max(1),
            max_in_flight_batches: batches,
            retention: args
                .retention_secs
                .map_or(RelayConfig::default().retention, Duration::from_secs),
            vacuum_after_rows: args
                .vacuum_after_rows
                .unwrap_or(RelayConfig::default().vacuum_after_rows),
            ..RelayConfig::default()
        },
    );
    let started = Instant::now();
    let r = relay.drain(&CancellationToken::new()).await?;
    anyhow::ensure!(r.retried + r.dead == 0, "publish failures during the run");
    let published = r.published;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(published == n, "published {published} of {n}");
    Ok(n as f64 / secs)
}

/// Commit-to-publish latency: writers commit one event per transaction at `rate`/s for
/// `secs` while a relay runs (LISTEN/NOTIFY on PostgreSQL); latency is the relay's
/// `published_at` (broker confirmation) minus the writer's commit time. Returns sorted ms,
/// and each event's [`Stages`] from this process's stamps.
async fn latency(
    db: &Database,
    target: &Target,
    rate: u64,
    secs: u64,
    window: usize,
    in_flight_batches: Option<usize>,
) -> anyhow::Result<(Vec<i64>, Stages)> {
    let stop = CancellationToken::new();
    let defaults = RelayConfig::default();
    let clock = Clock::start();
    let stamped = Arc::new(Stamped::new(target.publisher.clone(), clock));
    let relay = Relay::new(
        db.clone(),
        stamped.clone(),
        RelayConfig {
            batch_size: u32::try_from(window).unwrap_or(u32::MAX),
            max_in_flight_batches: in_flight_batches.unwrap_or(defaults.max_in_flight_batches),
            // Published rows are kept, to read their `published_at` (the broker's
            // confirmation time) below; keeping them costs the relay a write per event.
            retention: Duration::from_secs(3600),
            ..defaults
        },
    );
    let relay = tokio::spawn(relay.run(stop.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let writers = 4_u64;
    let per_writer = (rate / writers).max(1);
    let total = per_writer * secs;
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let db = db.clone();
            let topic = target.topic.clone();
            tokio::spawn(async move {
                let mut commits = HashMap::new();
                let mut written = HashMap::new();
                let mut tick =
                    tokio::time::interval(Duration::from_secs_f64(1.0 / per_writer as f64));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                for k in 0..total {
                    tick.tick().await;
                    let e = event(&topic, (w * total + k) as usize);
                    let message_id = e.message_id;
                    let begun = clock.now();
                    let mut tx = db.begin().await?;
                    let id = OutboxStore::enqueue(&mut tx, &e).await?;
                    tx.commit().await?;
                    commits.insert(id, oncely_core::now_ms());
                    let committed = clock.now();
                    written.insert(message_id, Written { begun, committed });
                }
                Ok::<_, anyhow::Error>((commits, written))
            })
        })
        .collect();
    let (mut commits, mut written) = (HashMap::new(), HashMap::new());
    for t in tasks {
        let (c, w) = t.await??;
        commits.extend(c);
        written.extend(w);
    }
    let store = OutboxStore::new(db.clone());
    let deadline = Instant::now() + Duration::from_secs(30);
    while store.stats().await?.pending > 0 {
        anyhow::ensure!(Instant::now() < deadline, "the relay did not drain");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    relay.await?;
    let mut lat = Vec::with_capacity(commits.len());
    for (id, committed) in commits {
        let row = store.get(id).await?.context("row vanished")?;
        let published = row.published_at.context("row not published")?;
        lat.push((published - committed).max(0));
    }
    lat.sort_unstable();
    Ok((lat, Stages::collect(&written, &stamped)))
}

pub(crate) async fn run(args: RelayBenchArgs) -> anyhow::Result<()> {
    let options = DbOptions {
        max_connections: 16,
        ..DbOptions::default()
    };
    println!(
        "relay benchmark: database {}, {} events per throughput run, window {} ({} batches \
         in flight), {} rounds, published rows kept {} s, vacuum after {} rows",
        if args.database_url.starts_with("sqlite") {
            "SQLite"
        } else {
            "PostgreSQL"
        },
        args.events,
        args.window,
        args.in_flight_batches,
        args.rounds,
        args.retention_secs
            .unwrap_or(RelayConfig::default().retention.as_secs()),
        args.vacuum_after_rows
            .unwrap_or(RelayConfig::default().vacuum_after_rows)
    );
    for broker in [Broker::RabbitMq, Broker::Nats, Broker::Kafka] {
        if !args.brokers.iter().any(|b| b == broker.name()) {
            continue;
        }
        let target = match Target::new(broker, &args, args.window).await {
            Ok(t) => t,
            Err(e) => {
                println!("{}: SKIPPED ({e:#})", broker.name());
                continue;
            }
        };
        let test_db = TestDb::fresh(&args.database_url, &options)
            .await
            .context("database unreachable")?;
        test_db.db.migrate().await?;
        // Warm-up, then alternate raw / relay so drift hits both; report medians.
        target.raw(&args, 1000, args.window).await?;
        let (mut raws, mut relays, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
        for round in 1..=args.rounds.max(1) {
            let raw = target.raw(&args, args.events, args.window).await?;
            let relay = relay_throughput(&test_db.db, &target, &args).await?;
            println!(
                "{:>8}: round {round}: relay {relay:>8.0} events/s | raw client {raw:>8.0} msg/s \
                 | ratio {:.2}",
                broker.name(),
                relay / raw
            );
            raws.push(raw);
            relays.push(relay);
            ratios.push(relay / raw);
        }
        println!(
            "{:>8}: relay {:>8.0} events/s | raw client {:>8.0} msg/s (same confirmation \
             window) | ratio {:.2} (medians of {} rounds)",
            broker.name(),
            median(&mut relays),
            median(&mut raws),
            median(&mut ratios),
            ratios.len()
        );
        let raw_lat = target.raw_latency(&args, args.rate, args.seconds).await?;
        println!(
            "{:>8}: raw client publish-to-confirm at {} msg/s for {} s: p50 {} ms, p99 {} ms, \
             max {} ms (n = {})",
            broker.name(),
            args.rate,
            args.seconds,
            quantile(&raw_lat, 0.50).unwrap_or(0),
            quantile(&raw_lat, 0.99).unwrap_or(0),
            raw_lat.last().copied().unwrap_or(0),
            raw_lat.len()
        );
        let (lat, stages) = latency(
            &test_db.db,
            &target,
            args.rate,
            args.seconds,
            args.window,
            args.latency_in_flight_batches,
        )
        .await?;
        println!(
            "{:>8}: commit-to-publish at {} events/s for {} s: p50 {} ms, p99 {} ms, max {} ms \
             (n = {})",
            broker.name(),
            args.rate,
            args.seconds,
            quantile(&lat, 0.50).unwrap_or(0),
            quantile(&lat, 0.99).unwrap_or(0),
            lat.last().copied().unwrap_or(0),
            lat.len()
        );
        for line in stages.lines(broker.name()) {
            println!("{line}");
        }
        target.cleanup().await;
    }
    Ok(())
}
