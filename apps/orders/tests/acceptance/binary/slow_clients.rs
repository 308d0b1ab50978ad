//! Slow clients (issue 14 §4), against the real `orders serve` process: bodies that stall or
//! trickle are cut by the body deadline, and the memory stalled uploads can pin is bounded
//! by the body budget. Settings go in as environment variables, so an older binary runs the
//! same test (and fails it) instead of refusing an unknown flag.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use oncely_testkit::{TestBackend, TestDb};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::{order, post, serve_with_env, API_KEY};

const BODY_TIMEOUT_SECS: u64 = 5;
const BODY_TIMEOUT: &str = "5";
const MIB: usize = 1024 * 1024;
/// The stated bound on the server's peak RSS with the default limits (README).
const PEAK_RSS_BOUND_KIB: u64 = 400 * 1024;
/// Every connection's body bytes come from this one buffer: the test process must not
/// hold 800 MiB itself.
static CHUNK: [u8; 64 * 1024] = [b' '; 64 * 1024];

fn head(content_length: usize, key: &str) -> String {
    format!(
        "POST /v1/orders HTTP/1.1\r\nhost: oncely\r\nauthorization: Bearer {API_KEY}\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\n\
         content-length: {content_length}\r\n\r\n"
    )
}

/// Everything the server sends until it closes the connection (a reset ends it too,
/// possibly before its answer was read).
async fn until_closed(mut r: impl AsyncRead + Unpin) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n @ 1..) = r.read(&mut buf).await {
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// The status code of an HTTP/1.1 answer (`HTTP/1.1 408 …`).
fn status(answer: &[u8]) -> Option<u16> {
    std::str::from_utf8(answer.get(9..12)?).ok()?.parse().ok()
}

/// A `proc(5)` status field in KiB (`VmHWM`, `VmRSS`).
fn proc_kib(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// Sends the head and 1 MiB − 1 byte of a 1 MiB body, then goes silent; returns the
/// server's answer, once it closes the connection.
async fn stalled_upload(addr: SocketAddr, n: usize) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head(MIB, &format!("stalled-{n}")).as_bytes())
        .await
        .unwrap();
    let mut left = MIB - 1;
    while left > 0 {
        let len = left.min(CHUNK.len());
        if s.write_all(&CHUNK[..len]).await.is_err() {
            break; // the server answered early and closed
        }
        left -= len;
    }
    until_closed(s).await
}

fn addr(base: &str) -> SocketAddr {
    base.strip_prefix("http://").unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn eight_hundred_stalled_uploads_are_cut_by_the_body_deadline_within_bounded_memory() {
    let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
    let p = serve_with_env(
        &t.url,
        &["--no-relay", "--no-consumer"],
        &[("ONCELY_BODY_READ_TIMEOUT_SECS", BODY_TIMEOUT)],
    );
    let pid = p.child.id();
    let before_kib = proc_kib(pid, "VmRSS");
    let slack = Duration::from_secs(15);
    let started = Instant::now();
    let uploads: Vec<_> = (0..800)
        .map(|n| {
            let addr = addr(&p.base);
            tokio::spawn(tokio::time::timeout(
                Duration::from_secs(BODY_TIMEOUT_SECS) + slack,
                stalled_upload(addr, n),
            ))
        })
        .collect();
    let (mut timed_out, mut busy, mut reset) = (0, 0, 0);
    for upload in uploads {
        let answer = upload
            .await
            .unwrap()
            .expect("every stalled upload is cut within the body deadline + 15 s");
        match status(&answer) {
            Some(408) => timed_out += 1,
            Some(503) => busy += 1,
            None => reset += 1,
            Some(other) => panic!("unexpected {other}: {}", String::from_utf8_lossy(&answer)),
        }
    }
    let elapsed = started.elapsed();
    let peak_kib = proc_kib(pid, "VmHWM");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after_kib = proc_kib(pid, "VmRSS");
    eprintln!(
        "800 stalled uploads: {timed_out} × 408, {busy} × 503, {reset} reset, all closed \
         after {elapsed:?}; server RSS before {before_kib} KiB, peak (VmHWM) {peak_kib} \
         KiB, 2 s after the last close {after_kib} KiB"
    );
    assert!(
        peak_kib < PEAK_RSS_BOUND_KIB,
        "peak RSS {peak_kib} KiB over the bound"
    );
    // The default budget (64 MiB) holds 64 reservations of 1 MiB at once: those run into
    // the deadline, the others are turned away without being read. (More than 64 × 408
    // in all only if some heads arrived after the first 64 were cut — a slow machine.)
    assert!(timed_out > 0, "no body ran into the deadline");
    assert!(busy > 0, "the body budget turned nobody away");
    // And the service still serves.
    let created = post(
        &reqwest::Client::new(),
        &p.base,
        "after-the-storm",
        &order("after-the-storm"),
    )
    .await;
    assert_eq!(created.0, 201);
}

/// Opens a connection with a 1 KiB receive buffer and pipelines `GET /metrics` on it
/// until the server stops taking requests (its answers are never read, so its writes
/// stall and it stops reading); returns the stream, still open and unread.
async fn never_reading(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(1024).unwrap();
    let mut s = socket.connect(addr).await.unwrap();
    let request = b"GET /metrics HTTP/1.1\r\nhost: oncely\r\n\r\n";
    while let Ok(Ok(())) = tokio::time::timeout(Duration::from_secs(1), s.write_all(request)).await
    {
    }
    s
}

/// Clients that send requests and never read the answers (issue 14's tester: 520 of them
/// locked every other client out for 70+ s, past every read deadline): with the
/// connection cap at 8, eight such clients fill it, and a ninth client is still served
/// once the server's stalled writes pass the write timeout and their connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_their_answers_lose_their_connections_after_the_write_timeout() {
    const WRITE_TIMEOUT_SECS: u64 = 3;
    let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
    let p = serve_with_env(
        &t.url,
        &["--no-relay", "--no-consumer"],
        &[
            ("ONCELY_MAX_CONNECTIONS", "8"),
            ("ONCELY_WRITE_TIMEOUT_SECS", "3"),
        ],
    );
    let held = futures_util::future::join_all((0..8).map(|_| never_reading(addr(&p.base)))).await;
    let started = Instant::now();
    let client = reqwest::Client::new();
    let probe = tokio::time::timeout(Duration::from_secs(WRITE_TIMEOUT_SECS + 15), async {
        loop {
            let answer = client
                .get(format!("{}/healthz", p.base))
                .timeout(Duration::from_secs(2))
                .send()
                .await;
            if let Ok(r) = answer {
                return r.status();
            }
        }
    })
    .await
    .expect("a new client is served within the write timeout + 15 s");
    assert_eq!(probe, 200);
    eprintln!(
        "8 never-reading clients held the cap; a new client served after {:?}",
        started.elapsed()
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickled_a_byte_per_quarter_second_is_cut_at_the_body_deadline() {
    let t = TestDb::new(TestBackend::Sqlite).await.unwrap();
    let p = serve_with_env(
        &t.url,
        &["--no-relay", "--no-consumer"],
        &[("ONCELY_BODY_READ_TIMEOUT_SECS", BODY_TIMEOUT)],
    );
    let s = TcpStream::connect(addr(&p.base)).await.unwrap();
    let (rd, mut wr) = s.into_split();
    wr.write_all(head(1000, "trickled").as_bytes())
        .await
        .unwrap();
    let started = Instant::now();
    // 1000 bytes at 4 a second would take 250 s; every byte arrives well within any
    // idle timeout.
    let trickle = tokio::spawn(async move {
        for _ in 0..1000 {
            if wr.write_all(b" ").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    let answer = tokio::time::timeout(
        Duration::from_secs(BODY_TIMEOUT_SECS + 10),
        until_closed(rd),
    )
    .await
    .expect("the trickled body is cut within the body deadline + 10 s");
    let elapsed = started.elapsed();
    trickle.abort();
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status(&answer), Some(408), "{text}");
    assert!(
        text.contains("urn:oncely:problem:request-timeout"),
        "{text}"
    );
    assert!(
        elapsed >= Duration::from_secs(BODY_TIMEOUT_SECS - 1),
        "cut after {elapsed:?}, before the deadline"
    );
    eprintln!("trickled body cut after {elapsed:?}");
}
