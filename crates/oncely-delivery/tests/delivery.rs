//! [`DeliveryHandler`] against a real HTTP peer on 127.0.0.1:0 (a TCP listener that reads
//! one request and writes a canned answer, or none): the request's headers and signature,
//! redirects not followed, `Retry-After` waited out, a refusal as [`Rejected`], a timeout
//! and a dropped connection as [`Unavailable`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use oncely_broker::{Message, Publisher as _, ReceivedMessage, SqlTransport};
use oncely_core::MessageId;
use oncely_delivery::{DeliveryConfig, DeliveryHandler, SigningSecret, Unavailable};
use oncely_inbox::Rejected;
use oncely_testkit::{TestBackend, TestDb};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

/// A peer that answers each connection with `answers[i]` (`None`: closes without an
/// answer; `Some("")`: never answers) and hands back what it read.
async fn peer(
    answers: Vec<Option<&'static str>>,
) -> (String, tokio::task::JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let mut requests = Vec::new();
        for answer in answers {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0_u8; 64 * 1024];
            let mut read = 0;
            // Headers and the (small) body: until the body's length has arrived.
            loop {
                let n = socket.read(&mut buf[read..]).await.unwrap();
                read += n;
                let text = String::from_utf8_lossy(&buf[..read]).to_string();
                if let Some((head, body)) = text.split_once("\r\n\r\n") {
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length: ")
                                .map(str::to_owned)
                        })
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if body.len() >= len {
                        requests.push(text);
                        break;
                    }
                }
                if n == 0 {
                    break;
                }
            }
            match answer {
                Some("") => tokio::time::sleep(Duration::from_secs(30)).await,
                Some(a) => socket.write_all(a.as_bytes()).await.unwrap(),
                None => {}
            }
            drop(socket);
        }
        requests
    });
    (url, task)
}

fn handler(url: &str, timeout: Duration) -> DeliveryHandler {
    let mut config =
        DeliveryConfig::new(url.parse().unwrap(), SigningSecret::parse(SECRET).unwrap());
    config.timeout = timeout;
    config.retry_after_ceiling = Duration::from_secs(2);
    DeliveryHandler::new(config).unwrap()
}

/// A message with every header a delivery forwards (and one it does not), as a broker
/// hands it over: published to and received from the SQL transport on SQLite (the test
/// database lives as long as the returned [`TestDb`]).
async fn message() -> (TestDb, ReceivedMessage) {
    let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
    t.db.migrate().await.unwrap();
    let transport = SqlTransport::new(t.db.clone(), 1 << 20);
    let headers = BTreeMap::from([
        ("correlation-id".to_owned(), "corr-1".to_owned()),
        (
            "traceparent".to_owned(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_owned(),
        ),
        ("tenant".to_owned(), "t-9".to_owned()),
        (
            "content-type".to_owned(),
            "application/vnd.order+json".to_owned(),
        ),
        ("idempotency-key".to_owned(), "not-forwarded".to_owned()),
    ]);
    let m = Message {
        id: MessageId::new_random(),
        topic: "orders".to_owned(),
        partition_key: "order-7".to_owned(),
        event_type: "order.created".to_owned(),
        payload: br#"{"n":7}"#.to_vec(),
        headers,
    };
    for r in transport.publish(&[m]).await {
        r.unwrap();
    }
    let received = transport.receive("orders", 1).await.unwrap().remove(0);
    (t, received)
}

fn header<'a>(request: &'a str, name: &str) -> Option<&'a str> {
    request.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test]
async fn a_2xx_is_delivered_with_the_signed_webhook_headers_and_the_message_headers() {
    let (url, peer) = peer(vec![Some("HTTP/1.1 204 No Content\r\n\r\n")]).await;
    let (_t, m) = message().await;
    handler(&url, Duration::from_secs(5))
        .deliver(&m)
        .await
        .unwrap();
    let requests = peer.await.unwrap();
    let r = &requests[0];
    assert!(r.starts_with("POST /hook HTTP/1.1\r\n"), "{r}");
    let id = m.id.to_string();
    assert_eq!(header(r, "webhook-id"), Some(id.as_str()));
    let ts: i64 = header(r, "webhook-timestamp").unwrap().parse().unwrap();
    assert!(
        (ts - oncely_core::now_ms() / 1000).abs() <= 5,
        "Unix seconds: {ts}"
    );
    let expected = SigningSecret::parse(SECRET)
        .unwrap()
        .sign(&id, ts, &m.payload);
    assert_eq!(header(r, "webhook-signature"), Some(expected.as_str()));
    assert_eq!(
        header(r, "content-type"),
        Some("application/vnd.order+json")
    );
    assert_eq!(header(r, "event-type"), Some("order.created"));
    assert_eq!(header(r, "partition-key"), Some("order-7"));
    assert_eq!(header(r, "correlation-id"), Some("corr-1"));
    assert_eq!(header(r, "tenant"), Some("t-9"));
    assert!(header(r, "traceparent").unwrap().starts_with("00-0af7"));
    assert_eq!(header(r, "idempotency-key"), None);
    assert!(r.ends_with(r#"{"n":7}"#), "the payload byte for byte: {r}");
}

#[tokio::test]
async fn a_redirect_is_not_followed_and_is_unavailable() {
    let (url, peer) = peer(vec![Some(
        "HTTP/1.1 301 Moved Permanently\r\nlocation: http://127.0.0.1:9/elsewhere\r\ncontent-length: 0\r\n\r\n",
    )])
    .await;
    let e = handler(&url, Duration::from_secs(5))
        .deliver(&message().await.1)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<Unavailable>(),
            Some(Unavailable::Status { status: 301, .. })
        ),
        "{e}"
    );
    assert_eq!(peer.await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_400_is_rejected_with_its_status_and_body() {
    let (url, _peer) = peer(vec![Some(
        "HTTP/1.1 400 Bad Request\r\ncontent-length: 19\r\n\r\norder 7 is unknown\n",
    )])
    .await;
    let e = handler(&url, Duration::from_secs(5))
        .deliver(&message().await.1)
        .await
        .unwrap_err();
    let rejected = e.downcast_ref::<Rejected>().expect("a refusal is Rejected");
    assert_eq!(rejected.0, "HTTP 400 Bad Request: order 7 is unknown");
}

#[tokio::test]
async fn a_429_waits_out_its_retry_after_up_to_the_ceiling() {
    let (url, _peer) = peer(vec![
        Some("HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-length: 0\r\n\r\n"),
        Some("HTTP/1.1 503 Service Unavailable\r\nretry-after: 3600\r\ncontent-length: 0\r\n\r\n"),
    ])
    .await;
    let h = handler(&url, Duration::from_secs(5));
    let started = Instant::now();
    let e = h.deliver(&message().await.1).await.unwrap_err();
    assert!(matches!(
        e.downcast_ref::<Unavailable>(),
        Some(Unavailable::Status { status: 429, .. })
    ));
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let e = h.deliver(&message().await.1).await.unwrap_err();
    assert!(matches!(
        e.downcast_ref::<Unavailable>(),
        Some(Unavailable::Status { status: 503, .. })
    ));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(4),
        "the ceiling (2 s): {waited:?}"
    );
}

#[tokio::test]
async fn a_dropped_connection_a_timeout_and_a_refused_connection_are_unavailable() {
    let (url, _peer) = peer(vec![None, Some("")]).await;
    let h = handler(&url, Duration::from_millis(500));
    for _ in 0..2 {
        let e = h.deliver(&message().await.1).await.unwrap_err();
        assert!(
            matches!(
                e.downcast_ref::<Unavailable>(),
                Some(Unavailable::NoAnswer(_))
            ),
            "{e}"
        );
    }
    // Nothing listens on the port any more.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", closed.local_addr().unwrap());
    drop(closed);
    let e = handler(&url, Duration::from_secs(1))
        .deliver(&message().await.1)
        .await
        .unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<Unavailable>(),
            Some(Unavailable::NoAnswer(_))
        ),
        "{e}"
    );
}
