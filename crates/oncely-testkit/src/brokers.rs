use std::time::Duration;

use crate::require_services;

/// `ONCELY_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`.
pub fn amqp_url() -> String {
    std::env::var("ONCELY_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// `ONCELY_TEST_NATS_URL`, default `nats://127.0.0.1:4222`.
pub fn nats_url() -> String {
    std::env::var("ONCELY_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned())
}

/// `ONCELY_TEST_KAFKA_BROKERS`, default `127.0.0.1:9092`: Kafka bootstrap servers,
/// comma-separated `host:port` (librdkafka `bootstrap.servers`).
pub fn kafka_brokers() -> String {
    std::env::var("ONCELY_TEST_KAFKA_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".to_owned())
}

/// [`kafka_brokers`] as a URL (`kafka://host:port`, the first server) for
/// [`service_reachable`].
pub fn kafka_url() -> String {
    let brokers = kafka_brokers();
    let first = brokers.split(',').next().unwrap_or_default().trim();
    format!("kafka://{first}")
}

/// The `host:port` of a `scheme://[user[:password]@]host:port[/…]` URL.
pub fn url_authority(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let rest = rest.split(['/', '?']).next()?;
    let hostport = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    (!hostport.is_empty()).then(|| hostport.to_owned())
}

/// `true` when `name` at `url` accepts a TCP connection within 3 s. Otherwise prints
/// `SKIPPED` and returns `false` — or panics when [`require_services`] is set.
///
/// # Panics
/// When the service is unreachable and services are required.
pub async fn service_reachable(name: &str, url: &str) -> bool {
    let why = match url_authority(url) {
        None => format!("cannot parse {url}"),
        Some(addr) => match tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(&addr),
        )
        .await
        {
            Ok(Ok(_)) => return true,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        },
    };
    assert!(
        !require_services(),
        "{name} at {url} is required but unreachable: {why}"
    );
    eprintln!("SKIPPED: {name} at {url} unreachable ({why})");
    false
}
