//! The proxy itself: accept, attribute, forward, apply the order's next fault.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use super::{Answer, BodyFault, Fault, ProxyOptions, RequestView, Schedule};

/// An HTTP fault proxy on `127.0.0.1:0` in front of one provider; stopped on drop.
#[derive(Debug)]
pub struct HttpFaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HttpFaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the proxy knows of one order.
#[derive(Debug, Default)]
struct OrderState {
    schedule: Option<Schedule>,
    effects_seen: usize,
    lookups_seen: usize,
    log: Vec<String>,
}

#[derive(Default)]
struct Tables {
    orders: HashMap<String, OrderState>,
    /// Strings that name an order: its metadata values, its objects' ids.
    aliases: HashMap<String, String>,
    /// When the proxy first saw each object, by id: `(order, when)`.
    objects: HashMap<String, (String, Instant)>,
    unattributed: Vec<String>,
}

struct Shared {
    upstream: String,
    options: ProxyOptions,
    client: reqwest::Client,
    tables: Mutex<Tables>,
    planned: Notify,
    started: Instant,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

type Reply = Result<http::Response<Full<Bytes>>, ProxyReset>;

/// The service's error: hyper closes the connection without an answer.
#[derive(Debug)]
struct ProxyReset;

impl fmt::Display for ProxyReset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("connection reset by the fault proxy")
    }
}

impl std::error::Error for ProxyReset {}

impl HttpFaultProxy {
    /// Starts a proxy forwarding to `upstream` (a base URL such as `http://127.0.0.1:4242`).
    ///
    /// # Panics
    /// When no local port can be bound.
    pub async fn start(upstream: &str, options: ProxyOptions) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_owned(),
            options,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .timeout(Duration::from_secs(60))
                .build()
                .expect("proxy client"),
            tables: Mutex::new(Tables::default()),
            planned: Notify::new(),
            started: Instant::now(),
        });
        let task = tokio::spawn(accept(listener, shared.clone()));
        Self { addr, shared, task }
    }

    /// The proxy's base URL, `http://127.0.0.1:PORT`: give it to the service as the
    /// provider's.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Sets `order`'s schedule (requests of the order waiting for one go on).
    pub fn plan(&self, order: &str, schedule: Schedule) {
        self.shared
            .lock()
            .orders
            .entry(order.to_owned())
            .or_default()
            .schedule = Some(schedule);
        self.shared.planned.notify_waiters();
    }

    /// What the proxy did to `order`'s requests, one line each, oldest first.
    pub fn log(&self, order: &str) -> Vec<String> {
        self.shared
            .lock()
            .orders
            .get(order)
            .map(|o| o.log.clone())
            .unwrap_or_default()
    }

    /// The requests no order was found for, one line each.
    pub fn unattributed(&self) -> Vec<String> {
        self.shared.lock().unattributed.clone()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Tables> {
        self.tables
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn note(&self, order: Option<&str>, line: &str) {
        let line = format!("+{}ms {line}", self.started.elapsed().as_millis());
        let mut t = self.lock();
        match order {
            Some(o) => t.orders.entry(o.to_owned()).or_default().log.push(line),
            None => t.unattributed.push(line),
        }
    }

    /// The order `view` belongs to: named in it, or through a learned alias or object id.
    fn attribute(&self, view: &RequestView<'_>) -> Option<String> {
        if let Some(o) = (self.options.order_of)(view) {
            return Some(o);
        }
        let t = self.lock();
        let body = String::from_utf8_lossy(view.body);
        t.aliases
            .iter()
            .find(|(alias, _)| {
                view.target.contains(alias.as_str()) || body.contains(alias.as_str())
            })
            .map(|(_, o)| o.clone())
    }

    /// Learns the metadata values of a request of `order` as its aliases.
    fn learn_request(&self, order: &str, body: &[u8]) {
        let mut t = self.lock();
        for (k, v) in form_urlencoded::parse(body) {
            if k.starts_with("metadata[") && v.len() >= 8 {
                t.aliases.insert(v.into_owned(), order.to_owned());
            }
        }
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            if let Some(r) = v["merchant_reference"].as_str() {
                t.aliases.insert(r.to_owned(), order.to_owned());
            }
        }
    }

    /// Learns the ids of the objects in a provider's answer (the object itself or its
    /// `data`), each under the order its text names.
    fn learn_answer(&self, order: Option<&str>, body: &[u8]) {
        let Ok(v) = serde_json::from_slice::<Value>(body) else {
            return;
        };
        let mut t = self.lock();
        let objects: Vec<&Value> = match v["data"].as_array() {
            Some(items) => items.iter().collect(),
            None => vec![&v],
        };
        for obj in objects {
            let Some(id) = obj["id"].as_str() else {
                continue;
            };
            if t.objects.contains_key(id) {
                continue;
            }
            let text = obj.to_string();
            let owner = order
                .filter(|o| text.contains(*o))
                .map(str::to_owned)
                .or_else(|| t.orders.keys().find(|o| text.contains(o.as_str())).cloned());
            if let Some(o) = owner {
                t.aliases.insert(id.to_owned(), o.clone());
                t.objects.insert(id.to_owned(), (o, Instant::now()));
            }
        }
    }

    /// The next fault of `order` for a request of this kind, waiting a while for its plan.
    async fn next_fault(&self, order: &str, lookup: bool) -> Fault {
        let deadline = tokio::time::Instant::now() + self.options.wait_for_plan;
        loop {
            let notified = self.planned.notified();
            {
                let mut t = self.lock();
                let state = t.orders.entry(order.to_owned()).or_default();
                if let Some(s) = &state.schedule {
                    let (list, seen) = if lookup {
                        (&s.lookups, &mut state.lookups_seen)
                    } else {
                        (&s.effects, &mut state.effects_seen)
                    };
                    let fault = list.get(*seen).cloned().unwrap_or(Fault::Pass);
                    *seen += 1;
                    return fault;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Fault::Pass;
            }
        }
    }

    /// Rewrites a listing answer: hides lagging objects and, for [`Fault::EmptyPage`], the
    /// order's objects; replaces the status word of a [`Fault::StatusWord`]. An answer no
    /// order was found for (a list paged by every status check) takes, for each order with
    /// objects in it, that order's next lookup fault when it is one of these rewrites. The
    /// notes of what it changed.
    fn rewrite_lookup(&self, order: Option<&str>, fault: &Fault, body: &[u8]) -> (Bytes, String) {
        let Ok(mut v) = serde_json::from_slice::<Value>(body) else {
            return (Bytes::copy_from_slice(body), String::new());
        };
        let mut t = self.lock();
        let owner_of = |t: &Tables, obj: &Value| -> Option<(String, Instant)> {
            let id = obj["id"].as_str()?;
            t.objects.get(id).cloned()
        };
        let mut rewrites: HashMap<String, Fault> = HashMap::new();
        if let Some(o) = order {
            rewrites.insert(o.to_owned(), fault.clone());
        } else {
            let owners: Vec<String> = v["data"]
                .as_array()
                .map(|items| {
                    items
                        .iter()
                        .filter_map(|i| owner_of(&t, i))
                        .map(|(o, _)| o)
                        .collect()
                })
                .unwrap_or_default();
            for o in owners {
                if rewrites.contains_key(&o) {
                    continue;
                }
                let Some(state) = t.orders.get_mut(&o) else {
                    continue;
                };
                let next = state
                    .schedule
                    .as_ref()
                    .and_then(|s| s.lookups.get(state.lookups_seen).cloned());
                if let Some(f @ (Fault::EmptyPage | Fault::StatusWord(_))) = next {
                    state.lookups_seen += 1;
                    rewrites.insert(o, f);
                }
            }
        }
        let t = &*t;
        let window = self.options.hide_window;
        let mut notes = Vec::new();
        let hidden = |obj: &Value, notes: &mut Vec<String>| -> bool {
            let Some((o, seen)) = owner_of(t, obj) else {
                return false;
            };
            let age = seen.elapsed();
            if age >= window {
                return false;
            }
            let lag = t
                .orders
                .get(&o)
                .and_then(|s| s.schedule.as_ref())
                .map_or(0, |s| s.lag_ms);
            if rewrites.get(&o) == Some(&Fault::EmptyPage) {
                notes.push(format!("emptied {}", obj["id"]));
                return true;
            }
            if age < Duration::from_millis(lag) {
                notes.push(format!("lagged {}", obj["id"]));
                return true;
            }
            false
        };
        if let Some(items) = v.get_mut("data").and_then(Value::as_array_mut) {
            items.retain(|obj| !hidden(obj, &mut notes));
            for obj in items.iter_mut() {
                let word = owner_of(t, obj).and_then(|(o, _)| match rewrites.get(&o) {
                    Some(Fault::StatusWord(w)) => Some(w.clone()),
                    _ => None,
                });
                if let Some(word) = word {
                    notes.push(format!("status {}→{word}", obj["status"]));
                    obj["status"] = Value::String(word);
                }
            }
        } else if let Fault::StatusWord(word) = fault {
            if v.get("status").is_some() {
                notes.push(format!("status {}→{word}", v["status"]));
                v["status"] = Value::String(word.clone());
            }
        }
        (Bytes::from(v.to_string()), notes.join(", "))
    }
}

async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        // Every close by the proxy is then a reset, as a crashed middlebox looks.
        drop(stream.set_zero_linger());
        let shared = shared.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { handle(&shared, req).await }
            });
            drop(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await,
            );
        });
    }
}

/// What the provider answered to a forward: `(status, headers, body)`, or why not.
type Upstream = Result<(u16, http::HeaderMap, Bytes), String>;

async fn handle(shared: &Arc<Shared>, req: http::Request<hyper::body::Incoming>) -> Reply {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(http_body_util::Collected::to_bytes)
        .unwrap_or_default();
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), ToString::to_string);
    let decoded = percent_decode(&target);
    let view = RequestView {
        method: parts.method.as_str(),
        target: &decoded,
        body: &body,
    };
    let order = shared.attribute(&view);
    let lookup = parts.method == http::Method::GET;
    if let Some(o) = &order {
        if !lookup {
            shared.learn_request(o, &body);
        }
    }
    let fault = match &order {
        Some(o) => shared.next_fault(o, lookup).await,
        None => Fault::Pass,
    };
    let what = format!("{} {target}", parts.method);
    let send = |delay: u64| {
        let shared = shared.clone();
        let (method, headers, body, target) = (
            parts.method.clone(),
            parts.headers.clone(),
            body.clone(),
            target.clone(),
        );
        let order = order.clone();
        // Detached: the commit lands even when the caller gave up and hyper dropped us.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let answer = forward(&shared, method, &target, headers, body).await;
            if let Ok((_, _, b)) = &answer {
                shared.learn_answer(order.as_deref(), b);
            }
            answer
        })
    };
    let reply = match &fault {
        Fault::Before(answer) => {
            shared.note(
                order.as_deref(),
                &format!("{what} → {fault} (not forwarded)"),
            );
            return answer_with(shared, answer, None).await;
        }
        Fault::SlowCommit(ms) => {
            // Noted now: the caller may give up before the forward, which lands anyway.
            shared.note(
                order.as_deref(),
                &format!("{what} → {fault} (forward delayed)"),
            );
            send(*ms).await
        }
        _ => send(0).await,
    };
    let upstream: Upstream = reply.unwrap_or_else(|e| Err(e.to_string()));
    let (status, headers, upstream_body) = match upstream {
        Ok(u) => u,
        Err(e) => {
            shared.note(
                order.as_deref(),
                &format!("{what} → {fault}; upstream failed: {e}"),
            );
            return Err(ProxyReset);
        }
    };
    let listing = lookup && status == 200;
    let (body, notes) = if listing {
        shared.rewrite_lookup(order.as_deref(), &fault, &upstream_body)
    } else {
        (upstream_body.clone(), String::new())
    };
    shared.note(
        order.as_deref(),
        &format!(
            "{what} → {fault}; upstream {status} {}{}",
            summary(&upstream_body),
            if notes.is_empty() {
                String::new()
            } else {
                format!("; rewrote: {notes}")
            }
        ),
    );
    match &fault {
        Fault::After(answer) => answer_with(shared, answer, Some((status, &headers, &body))).await,
        _ => Ok(response(status, &headers, body)),
    }
}

/// A short trace of an answer: its object's id and status, or its error code.
fn summary(body: &[u8]) -> String {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return format!("({} bytes)", body.len());
    };
    if let Some(items) = v["data"].as_array() {
        let ids: Vec<String> = items
            .iter()
            .map(|i| {
                format!(
                    "{}:{}",
                    i["id"].as_str().unwrap_or("?"),
                    i["status"].as_str().unwrap_or("?")
                )
            })
            .collect();
        return format!("data[{}]", ids.join(" "));
    }
    if let Some(id) = v["id"].as_str() {
        return format!("{id}:{}", v["status"].as_str().unwrap_or("?"));
    }
    if v["error"].is_object() {
        return format!(
            "error {}",
            v["error"]["code"]
                .as_str()
                .or(v["error"]["type"].as_str())
                .unwrap_or("?")
        );
    }
    v["type"].as_str().unwrap_or("?").to_owned()
}

async fn forward(
    shared: &Shared,
    method: http::Method,
    target: &str,
    mut headers: http::HeaderMap,
    body: Bytes,
) -> Upstream {
    for h in ["host", "content-length", "connection", "transfer-encoding"] {
        headers.remove(h);
    }
    if shared.options.strip_idempotency_key {
        headers.remove("idempotency-key");
    }
    let res = shared
        .client
        .request(method, format!("{}{target}", shared.upstream))
        .headers(headers)
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.bytes().await.map_err(|e| e.to_string())?;
    Ok((status, headers, body))
}

fn response(status: u16, headers: &http::HeaderMap, body: Bytes) -> http::Response<Full<Bytes>> {
    let mut res = http::Response::new(Full::new(body));
    *res.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    for (k, v) in headers {
        if !matches!(
            k.as_str(),
            "content-length" | "connection" | "transfer-encoding"
        ) {
            res.headers_mut().append(k.clone(), v.clone());
        }
    }
    res
}

const JUNK: &[u8] = b"\x00\xff<html><body>upstream\x01 error";

/// Answers `answer`, after the provider's `upstream` answer when it was forwarded.
async fn answer_with(
    shared: &Shared,
    answer: &Answer,
    upstream: Option<(u16, &http::HeaderMap, &Bytes)>,
) -> Reply {
    match answer {
        Answer::Reset => Err(ProxyReset),
        Answer::Hang => {
            tokio::time::sleep(shared.options.hang).await;
            Err(ProxyReset)
        }
        Answer::Status { status, .. } if *status < 200 => {
            tokio::time::sleep(shared.options.hang).await;
            Err(ProxyReset)
        }
        Answer::Late(ms) => {
            tokio::time::sleep(Duration::from_millis(*ms)).await;
            Ok(match upstream {
                Some((s, h, b)) => response(s, h, b.clone()),
                None => response(502, &http::HeaderMap::new(), Bytes::new()),
            })
        }
        Answer::Status { status, body } => {
            let mut headers = http::HeaderMap::new();
            headers.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            let bytes = match (body, upstream) {
                (BodyFault::Upstream, Some((_, h, b))) => {
                    headers.clone_from(h);
                    b.clone()
                }
                (BodyFault::Garbled, Some((_, _, b))) => {
                    let mut g = b[..b.len() / 2].to_vec();
                    g.extend_from_slice(JUNK);
                    Bytes::from(g)
                }
                (BodyFault::Garbled, None) => Bytes::from_static(JUNK),
                _ => Bytes::new(),
            };
            Ok(response(*status, &headers, bytes))
        }
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}
