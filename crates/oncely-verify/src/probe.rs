//! Sending requests and reading answers: the HTTP client, the raw-socket hang-up, the
//! object counter.

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::header::{HeaderMap, HeaderValue, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use serde_json::Value;
use tokio::io::AsyncWriteExt as _;

use crate::config::{Header, ObjectIdSource, VerifyConfig};
use crate::report::RequestEvidence;

/// Which credential a request is sent with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cred {
    A,
    B,
}

/// One answer: its evidence and its body bytes (for byte-for-byte replay comparisons).
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) ev: RequestEvidence,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    pub(crate) fn status(&self) -> Option<u16> {
        self.ev.status
    }
    pub(crate) fn is_success(&self) -> bool {
        self.ev.status.is_some_and(|s| (200..300).contains(&s))
    }
    pub(crate) fn id(&self) -> Option<&str> {
        self.ev.object_id.as_deref()
    }
    /// `201`, or `no answer (error)`.
    pub(crate) fn describe(&self) -> String {
        match (self.ev.status, &self.ev.error) {
            (Some(s), _) => format!("{s}{}", if self.ev.replayed { " (replayed)" } else { "" }),
            (None, Some(e)) => format!("no answer ({e})"),
            (None, None) => "no answer".into(),
        }
    }
}

/// The client side of every check; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    client: reqwest::Client,
    pub(crate) cfg: Arc<VerifyConfig>,
    headers_a: Arc<Vec<Header>>,
    headers_b: Option<Arc<Vec<Header>>>,
}

impl Probe {
    pub(crate) fn new(cfg: VerifyConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder()
            .timeout(cfg.request_timeout)
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(cfg.concurrency.max(1))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let headers_b = cfg.credential_b().map(Arc::new);
        Ok(Self {
            client,
            headers_a: Arc::new(cfg.headers.clone()),
            headers_b,
            cfg: Arc::new(cfg),
        })
    }

    pub(crate) fn has_credential_b(&self) -> bool {
        self.headers_b.is_some()
    }

    fn headers(&self, cred: Cred) -> &[Header] {
        match (cred, &self.headers_b) {
            (Cred::B, Some(b)) => b,
            _ => &self.headers_a,
        }
    }

    /// The header value for `key`: bare, or an RFC 8941 sf-string with `quote_keys`.
    pub(crate) fn key_value(&self, key: &[u8]) -> Vec<u8> {
        if !self.cfg.quote_keys {
            return key.to_vec();
        }
        let mut out = Vec::with_capacity(key.len() + 2);
        out.push(b'"');
        for &b in key {
            if b == b'"' || b == b'\\' {
                out.push(b'\\');
            }
            out.push(b);
        }
        out.push(b'"');
        out
    }

    fn needs_content_type(&self, cred: Cred, body: &str) -> bool {
        !self.headers(cred).iter().any(|h| h.name == CONTENT_TYPE)
            && serde_json::from_str::<serde::de::IgnoredAny>(body).is_ok()
    }

    /// Sends one request with `key` (raw bytes, formatted by [`Self::key_value`]) or none.
    pub(crate) async fn send(
        &self,
        step: impl Into<String>,
        cred: Cred,
        key: Option<&[u8]>,
        body: &str,
    ) -> Answer {
        let credential = if cred == Cred::A { 'a' } else { 'b' };
        let mut ev = evidence(step.into(), credential, key);
        let mut req = self
            .client
            .request(self.cfg.method.clone(), self.cfg.url.clone())
            .body(body.to_owned());
        for h in self.headers(cred) {
            req = req.header(h.name.clone(), h.value.clone());
        }
        if self.needs_content_type(cred, body) {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        if let Some(k) = key {
            let Ok(v) = HeaderValue::from_bytes(&self.key_value(k)) else {
                ev.error = Some("the key cannot be sent as an HTTP header value".into());
                return Answer { ev, body: vec![] };
            };
            req = req.header(self.cfg.key_header.clone(), v);
        }
        let started = Instant::now();
        let result = async {
            let res = req.send().await?;
            let status = res.status().as_u16();
            let headers = res.headers().clone();
            let body = res.bytes().await?.to_vec();
            Ok::<_, reqwest::Error>((status, headers, body))
        }
        .await;
        ev.elapsed_ms = ms(started.elapsed());
        match result {
            Ok((status, headers, body)) => {
                ev.status = Some(status);
                ev.replayed = self.is_replay(&headers);
                ev.retry_after = header_str(&headers, &RETRY_AFTER);
                ev.body_bytes = body.len();
                if (200..300).contains(&status) {
                    ev.object_id = self.object_id(&headers, &body);
                }
                Answer { ev, body }
            }
            Err(e) => {
                ev.error = Some(oncely_core::error_chain(&e));
                Answer { ev, body: vec![] }
            }
        }
    }

    /// Retries with `key` while the answer is 409 (in flight), up to the settle timeout,
    /// honouring `Retry-After` (at most 1 s per wait). Returns every answer.
    pub(crate) async fn settle(
        &self,
        step: &str,
        cred: Cred,
        key: &[u8],
        body: &str,
    ) -> Vec<Answer> {
        let deadline = Instant::now() + self.cfg.settle_timeout;
        let mut out = Vec::new();
        for attempt in 1.. {
            let a = self
                .send(format!("{step} (attempt {attempt})"), cred, Some(key), body)
                .await;
            let again = a.status() == Some(409) && Instant::now() < deadline;
            let wait =
                a.ev.retry_after
                    .as_deref()
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .map_or(Duration::from_millis(100), |s| {
                        Duration::from_secs(s).min(Duration::from_secs(1))
                    });
            out.push(a);
            if !again {
                break;
            }
            tokio::time::sleep(wait).await;
        }
        out
    }

    fn is_replay(&self, headers: &HeaderMap) -> bool {
        headers.get(&self.cfg.replay_header).is_some_and(|v| {
            let v = v.to_str().unwrap_or("").trim();
            !(v.eq_ignore_ascii_case("false") || v == "?0" || v == "0")
        })
    }

    fn object_id(&self, headers: &HeaderMap, body: &[u8]) -> Option<String> {
        let pointer = |p: &str| {
            let v: Value = serde_json::from_slice(body).ok()?;
            match v.pointer(p)? {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                other => Some(other.to_string()),
            }
        };
        match &self.cfg.object_id {
            ObjectIdSource::Location => header_str(headers, &LOCATION),
            ObjectIdSource::Pointer(p) => pointer(p),
            ObjectIdSource::Auto => pointer("/id").or_else(|| header_str(headers, &LOCATION)),
        }
    }

    /// Objects counted at `count_url` (with the first credential's headers).
    pub(crate) async fn count(&self) -> Option<Result<u64, String>> {
        let url = self.cfg.count_url.clone()?;
        let mut req = self.client.get(url);
        for h in self.headers(Cred::A) {
            if h.name != CONTENT_TYPE {
                req = req.header(h.name.clone(), h.value.clone());
            }
        }
        let res = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                return Some(Err(format!(
                    "--count-url: {}",
                    oncely_core::error_chain(&e)
                )))
            }
        };
        let status = res.status();
        let text = match res.text().await {
            Ok(t) => t,
            Err(e) => {
                return Some(Err(format!(
                    "--count-url: {}",
                    oncely_core::error_chain(&e)
                )))
            }
        };
        if !status.is_success() {
            return Some(Err(format!("--count-url answered {status}")));
        }
        Some(parse_count(&text).ok_or_else(|| {
            "--count-url: expected a number, a JSON array or an object with `count` or `total`"
                .to_owned()
        }))
    }

    /// Writes the whole request to a new TCP connection, waits until the answer starts to
    /// arrive (so the server has executed), and closes the socket without reading it.
    /// `http://` only.
    pub(crate) async fn hang_up(&self, step: &str, key: &[u8], body: &str) -> RequestEvidence {
        let mut ev = evidence(step.to_owned(), 'a', Some(key));
        let started = Instant::now();
        let result = self.hang_up_inner(key, body).await;
        ev.elapsed_ms = ms(started.elapsed());
        ev.error = Some(match result {
            Ok(true) => {
                "request written; closed without reading once the answer began to arrive".into()
            }
            Ok(false) => {
                "request written; no answer began within the request timeout; closed".into()
            }
            Err(e) => format!("raw socket: {e}"),
        });
        ev
    }

    async fn hang_up_inner(&self, key: &[u8], body: &str) -> std::io::Result<bool> {
        let url = &self.cfg.url;
        let host = url.host_str().unwrap_or("localhost");
        let port = url.port_or_known_default().unwrap_or(80);
        let mut sock = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::net::TcpStream::connect((host.trim_matches(['[', ']']), port)),
        )
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out"))??;
        let mut target = url.path().to_owned();
        if let Some(q) = url.query() {
            target.push('?');
            target.push_str(q);
        }
        let authority = match url.port() {
            Some(p) => format!("{host}:{p}"),
            None => host.to_owned(),
        };
        let mut req = format!(
            "{} {target} HTTP/1.1\r\nHost: {authority}\r\n",
            self.cfg.method
        )
        .into_bytes();
        let mut header = |name: &[u8], value: &[u8]| {
            req.extend_from_slice(name);
            req.extend_from_slice(b": ");
            req.extend_from_slice(value);
            req.extend_from_slice(b"\r\n");
        };
        for h in self.headers(Cred::A) {
            header(h.name.as_str().as_bytes(), h.value.as_bytes());
        }
        if self.needs_content_type(Cred::A, body) {
            header(b"content-type", b"application/json");
        }
        header(
            self.cfg.key_header.as_str().as_bytes(),
            &self.key_value(key),
        );
        header(b"content-length", body.len().to_string().as_bytes());
        header(b"connection", b"close");
        req.extend_from_slice(b"\r\n");
        req.extend_from_slice(body.as_bytes());
        sock.write_all(&req).await?;
        sock.flush().await?;
        // Readiness does not consume the answer: it stays unread in the socket buffer and
        // the close below discards it (Linux answers the server with a reset).
        let arrived = tokio::time::timeout(self.cfg.request_timeout, sock.readable())
            .await
            .is_ok();
        drop(sock);
        Ok(arrived)
    }
}

fn parse_count(text: &str) -> Option<u64> {
    match serde_json::from_str::<Value>(text.trim()) {
        Ok(Value::Number(n)) => n.as_u64(),
        Ok(Value::Array(a)) => Some(a.len() as u64),
        Ok(Value::Object(o)) => o
            .get("count")
            .or_else(|| o.get("total"))
            .and_then(Value::as_u64),
        _ => text.trim().parse().ok(),
    }
}

fn header_str(headers: &HeaderMap, name: &reqwest::header::HeaderName) -> Option<String> {
    headers
        .get(name)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
}

/// Keys over 48 characters are shown as their start, their end and their length.
/// The evidence of a request about to be sent: its `step`, `credential` and `key`, no
/// answer yet.
fn evidence(step: String, credential: char, key: Option<&[u8]>) -> RequestEvidence {
    RequestEvidence {
        step,
        credential,
        key: key.map(shorten),
        status: None,
        replayed: false,
        object_id: None,
        retry_after: None,
        body_bytes: 0,
        error: None,
        elapsed_ms: 0.0,
    }
}

fn shorten(key: &[u8]) -> String {
    let s = String::from_utf8_lossy(key);
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= 48 {
        return s.escape_debug().to_string();
    }
    let head: String = chars[..24].iter().collect();
    let tail: String = chars[chars.len() - 8..].iter().collect();
    format!("{head}…{tail} ({} chars)", chars.len())
}

pub(crate) fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}
