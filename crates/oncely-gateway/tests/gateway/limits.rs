//! The slow-client limits the gateway shares with `orders serve` (`oncely_http::HttpLimits`):
//! a request head trickled past the header read timeout loses its connection; a guarded
//! body trickled past the body deadline gets 408, reaches nothing and leaves its key free.

use std::time::{Duration, Instant};

use oncely_gateway::GatewayConfig;
use oncely_http::HttpLimits;
use oncely_testkit::TestBackend;
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::{gateway_with, orders_route, post, test_db, Upstream, KEY_A};

/// Reads `stream` until the server closes it (at most 10 s): what it answered, and when.
async fn until_closed(stream: &mut TcpStream) -> (String, Duration) {
    let started = Instant::now();
    let mut answer = Vec::new();
    let mut buf = [0_u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    assert!(
        read.is_ok(),
        "the slow connection was still open after 10 s"
    );
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test]
async fn a_trickled_head_is_cut_off_and_a_trickled_body_gets_408_without_reaching_the_upstream() {
    let up = Upstream::start();
    let db = test_db(TestBackend::Sqlite, 4).await.unwrap();
    let mut config = GatewayConfig::new(up.base.as_str());
    config.routes = vec![orders_route()];
    config.http = HttpLimits {
        header_read_timeout: Duration::from_secs(1),
        body_read_timeout: Duration::from_secs(1),
        ..HttpLimits::default()
    };
    let gw = gateway_with(&db.db, &config).await;
    let addr = gw.base.trim_start_matches("http://");

    let mut head = TcpStream::connect(addr).await.unwrap();
    head.write_all(b"POST /orders HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let (_, took) = until_closed(&mut head).await;
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "closed after {took:?}, expected about 1 s"
    );

    let mut body = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY_A}\r\n\
         Idempotency-Key: k-slow\r\nContent-Type: application/json\r\n\
         Content-Length: 100\r\n\r\n{{\"external_ref\":"
    );
    body.write_all(request.as_bytes()).await.unwrap();
    let (answer, took) = until_closed(&mut body).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("urn:oncely:problem:request-timeout"),
        "{answer}"
    );
    assert!(took < Duration::from_secs(5), "answered after {took:?}");
    assert_eq!(up.count().await, 0, "nothing reached the upstream");

    let whole = json!({"external_ref": "r-slow"});
    let res = post(&gw.base, "/orders", KEY_A, Some("k-slow"), &whole).await;
    assert_eq!(res.status(), 201, "the key was left free");
    assert_eq!(up.count().await, 1);
}
