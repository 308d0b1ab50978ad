//! [`HttpFaultProxy`]: an HTTP/1.1 proxy between a service and a provider (`oncely sim`,
//! localstripe) that decides, per request and per order, what the provider seems to do.
//!
//! Each request is attributed to an order ([`ProxyOptions::order_of`], then the aliases
//! and object ids the proxy learned from earlier traffic of that order) and takes the next
//! [`Fault`] of that order's [`Schedule`]: the effect requests (every method but `GET`)
//! from [`Schedule::effects`], the lookups (`GET`) from [`Schedule::lookups`]; past the end
//! of a list, requests pass. The answer of every lookup that lists objects (Stripe's search
//! and list, the shipping lookup by `merchant_reference`) is also filtered by each listed
//! object's order: an object is hidden while that order's [`Schedule::lag`] since the proxy
//! first saw it has not passed (a search index that lags writes), but never past
//! [`ProxyOptions::hide_window`].
//!
//! Every forward runs in a task of its own, so a caller that gives up (its timeout) does
//! not cancel the commit at the provider — as with a real network. What the proxy did is
//! kept per order ([`HttpFaultProxy::log`]) for the failure report.

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

/// What the caller is answered instead of the provider's answer, or before anything is
/// forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Answer {
    /// This status (100–599) with `body`. A status below 200 is informational and cannot
    /// end an exchange (hyper refuses to send one as the final answer): the caller sees no
    /// final answer, as with [`Answer::Hang`].
    Status {
        /// The HTTP status code, 100–599.
        status: u16,
        /// The body sent with it.
        body: BodyFault,
    },
    /// The connection is reset (closed with `SO_LINGER` 0): no answer at all.
    Reset,
    /// Nothing is answered until the caller gives up (or [`ProxyOptions::hang`] passes,
    /// then the connection is reset).
    Hang,
    /// The provider's own answer, this long (ms) after it came: past the caller's timeout
    /// when longer than it.
    Late(u64),
}

/// The body of a replaced answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyFault {
    /// The provider's own body (only after forwarding; before, an empty body).
    Upstream,
    /// No body at all.
    Empty,
    /// Bytes that are not the JSON they claim to be: the provider's body cut in half with
    /// junk appended (after forwarding), or junk alone (before).
    Garbled,
}

/// What the proxy does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Forward it and answer what the provider answered.
    Pass,
    /// Do not forward it; answer this instead (a failure before the provider saw it).
    Before(Answer),
    /// Forward it (the provider commits), then answer this instead.
    After(Answer),
    /// Forward it only after this many ms (a slow commit: it lands even if the caller gave
    /// up meanwhile), then answer what the provider answered.
    SlowCommit(u64),
    /// Lookups: forward it, then drop this order's objects from the answer's `data` (an
    /// empty page), within [`ProxyOptions::hide_window`] of the object's creation.
    EmptyPage,
    /// Lookups: forward it, then replace the `status` of this order's objects in the
    /// answer (`processing`, `pending`, `label_created`, `in_transit`, …).
    StatusWord(String),
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pass => f.write_str("pass"),
            Self::Before(a) => write!(f, "before:{a}"),
            Self::After(a) => write!(f, "after:{a}"),
            Self::SlowCommit(ms) => write!(f, "slow-commit:{ms}ms"),
            Self::EmptyPage => f.write_str("empty-page"),
            Self::StatusWord(w) => write!(f, "status-word:{w}"),
        }
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Status { status, body } => write!(f, "{status}/{body:?}"),
            Self::Reset => f.write_str("reset"),
            Self::Hang => f.write_str("hang"),
            Self::Late(ms) => write!(f, "late:{ms}ms"),
        }
    }
}

/// One order's faults: what its effect requests and lookups meet, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The faults of the order's effect requests (every method but `GET`: creates,
    /// refunds, cancels), the first request taking the first; past the end, they pass.
    pub effects: Vec<Fault>,
    /// The faults of the order's lookups (`GET`), likewise.
    pub lookups: Vec<Fault>,
    /// How long (ms) each of the order's objects stays out of listing answers after the
    /// proxy first saw it (a lagging search index); at most
    /// [`ProxyOptions::hide_window`].
    pub lag_ms: u64,
}

/// A view of one request, for [`ProxyOptions::order_of`].
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// `GET`, `POST`, …
    pub method: &'a str,
    /// The path and query, percent-decoded.
    pub target: &'a str,
    /// The request body.
    pub body: &'a [u8],
}

/// Finds the order a request names ([`ProxyOptions::order_of`]).
pub type OrderOf = Arc<dyn Fn(&RequestView<'_>) -> Option<String> + Send + Sync>;

/// Settings of an [`HttpFaultProxy`].
#[derive(Clone)]
pub struct ProxyOptions {
    /// The order a request names, if any; [`order_of_request`] by default.
    pub order_of: OrderOf,
    /// Remove `Idempotency-Key` before forwarding: the provider then ignores keys.
    pub strip_idempotency_key: bool,
    /// Hiding faults ([`Schedule::lag_ms`], [`Fault::EmptyPage`]) never hide an object
    /// longer than this after the proxy first saw it. Default 1.5 s.
    pub hide_window: Duration,
    /// How long a request of an order without a schedule waits for
    /// [`HttpFaultProxy::plan`] before it passes. Default 3 s.
    pub wait_for_plan: Duration,
    /// How long [`Answer::Hang`] holds a request before resetting it. Default 10 s.
    pub hang: Duration,
}

impl fmt::Debug for ProxyOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxyOptions")
            .field("strip_idempotency_key", &self.strip_idempotency_key)
            .field("hide_window", &self.hide_window)
            .field("wait_for_plan", &self.wait_for_plan)
            .field("hang", &self.hang)
            .finish_non_exhaustive()
    }
}

impl Default for ProxyOptions {
    fn default() -> Self {
        Self {
            order_of: Arc::new(order_of_request),
            strip_idempotency_key: false,
            hide_window: Duration::from_millis(1_500),
            wait_for_plan: Duration::from_secs(3),
            hang: Duration::from_secs(10),
        }
    }
}

/// The order a request of the reference flows names: Stripe's form field
/// `metadata[order_id]`, a JSON body's `order_id`, a search query's
/// `metadata['order_id']:'…'`, or a shipping lookup's `merchant_reference=` (up to its
/// first `:`, so `{order}:ship` is `{order}`).
pub fn order_of_request(req: &RequestView<'_>) -> Option<String> {
    let body = String::from_utf8_lossy(req.body);
    for (k, v) in form_urlencoded::parse(body.as_bytes()) {
        if k == "metadata[order_id]" {
            return Some(v.into_owned());
        }
    }
    if let Ok(v) = serde_json::from_slice::<Value>(req.body) {
        if let Some(id) = v["order_id"].as_str() {
            return Some(id.to_owned());
        }
    }
    if let Some(rest) = req.target.split("metadata['order_id']:'").nth(1) {
        return rest.split('\'').next().map(str::to_owned);
    }
    let query = req.target.split_once('?')?.1;
    form_urlencoded::parse(query.as_bytes())
        .find(|(k, _)| k == "merchant_reference")
        .map(|(_, v)| v.split(':').next().unwrap_or_default().to_owned())
}

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

/// A seeded generator (SplitMix64): the same seed draws the same numbers, on every
/// platform, so a fault schedule is replayed from its seed alone.
#[derive(Debug, Clone)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A generator starting at `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `p` (0.0–1.0).
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1_u64 << 53) as f64 <= p
    }

    /// One of `items` (not empty).
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    /// A tiny upstream: `POST /v1/things` creates `{id, status, metadata{order_id}}`,
    /// `GET /v1/things` lists them; counts the creates.
    async fn upstream() -> (String, Arc<Mutex<Vec<Value>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let things = Arc::new(Mutex::new(Vec::<Value>::new()));
        let store = things.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let store = store.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |req: http::Request<hyper::body::Incoming>| {
                            let store = store.clone();
                            async move {
                                let post = req.method() == http::Method::POST;
                                let body = req.into_body().collect().await.unwrap().to_bytes();
                                let mut all = store.lock().unwrap();
                                let answer = if post {
                                    let order = order_of_request(&RequestView {
                                        method: "POST",
                                        target: "/",
                                        body: &body,
                                    })
                                    .unwrap();
                                    let thing = serde_json::json!({"id": format!("th_{}", all.len()), "status": "succeeded", "metadata": {"order_id": order}});
                                    all.push(thing.clone());
                                    thing
                                } else {
                                    serde_json::json!({"data": *all})
                                };
                                Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::from(
                                    answer.to_string(),
                                ))))
                            }
                        },
                    );
                    drop(
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await,
                    );
                });
            }
        });
        (base, things)
    }

    async fn create(
        client: &reqwest::Client,
        proxy: &HttpFaultProxy,
        order: &str,
    ) -> Result<(u16, String), reqwest::Error> {
        let res = client
            .post(format!("{}/v1/things", proxy.base_url()))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("metadata[order_id]={order}"))
            .send()
            .await?;
        Ok((res.status().as_u16(), res.text().await?))
    }

    #[tokio::test]
    async fn each_order_meets_its_own_schedule_and_the_commit_lands_after_the_fault() {
        let (base, things) = upstream().await;
        let proxy = HttpFaultProxy::start(&base, ProxyOptions::default()).await;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_millis(500))
            .build()
            .unwrap();
        proxy.plan(
            "order-aaaaaaaa",
            Schedule {
                effects: vec![
                    Fault::Before(Answer::Status {
                        status: 503,
                        body: BodyFault::Empty,
                    }),
                    Fault::After(Answer::Status {
                        status: 524,
                        body: BodyFault::Garbled,
                    }),
                    Fault::After(Answer::Reset),
                    Fault::SlowCommit(800),
                ],
                ..Schedule::default()
            },
        );
        proxy.plan("order-bbbbbbbb", Schedule::default());
        assert_eq!(
            create(&client, &proxy, "order-aaaaaaaa").await.unwrap().0,
            503
        );
        assert_eq!(things.lock().unwrap().len(), 0, "not forwarded");
        let (status, body) = create(&client, &proxy, "order-aaaaaaaa").await.unwrap();
        assert_eq!(status, 524);
        assert!(
            serde_json::from_str::<Value>(&body).is_err(),
            "garbled: {body}"
        );
        assert_eq!(things.lock().unwrap().len(), 1, "committed");
        assert!(
            create(&client, &proxy, "order-aaaaaaaa").await.is_err(),
            "reset"
        );
        assert_eq!(things.lock().unwrap().len(), 2);
        assert!(
            create(&client, &proxy, "order-aaaaaaaa").await.is_err(),
            "timed out"
        );
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(things.lock().unwrap().len(), 3, "the slow commit landed");
        assert_eq!(
            create(&client, &proxy, "order-aaaaaaaa").await.unwrap().0,
            200,
            "past the list"
        );
        assert_eq!(
            create(&client, &proxy, "order-bbbbbbbb").await.unwrap().0,
            200
        );
        assert_eq!(
            proxy.log("order-aaaaaaaa").len(),
            5,
            "{:?}",
            proxy.log("order-aaaaaaaa")
        );
    }

    #[tokio::test]
    async fn lookups_lag_empty_and_rewrite_only_their_orders_objects() {
        let (base, _things) = upstream().await;
        let options = ProxyOptions {
            hide_window: Duration::from_millis(400),
            ..ProxyOptions::default()
        };
        let proxy = HttpFaultProxy::start(&base, options).await;
        let client = reqwest::Client::new();
        proxy.plan(
            "order-lagging1",
            Schedule {
                lag_ms: 300,
                ..Schedule::default()
            },
        );
        proxy.plan(
            "order-worded11",
            Schedule {
                lookups: vec![Fault::StatusWord("processing".into()), Fault::EmptyPage],
                ..Schedule::default()
            },
        );
        create(&client, &proxy, "order-lagging1").await.unwrap();
        create(&client, &proxy, "order-worded11").await.unwrap();
        let list = |q: &'static str| {
            let (client, url) = (
                client.clone(),
                format!("{}/v1/things?{q}", proxy.base_url()),
            );
            async move {
                client
                    .get(url)
                    .send()
                    .await
                    .unwrap()
                    .json::<Value>()
                    .await
                    .unwrap()
            }
        };
        let page = list("merchant_reference=order-worded11:ship").await;
        let data = page["data"].as_array().unwrap();
        assert_eq!(
            data.len(),
            1,
            "the lagging order's object is hidden: {page}"
        );
        assert_eq!(data[0]["status"], "processing");
        let page = list("merchant_reference=order-worded11").await;
        assert_eq!(
            page["data"].as_array().unwrap().len(),
            0,
            "empty page: {page}"
        );
        // A list no order is named in takes each listed order's next rewrite.
        proxy.plan(
            "order-listed11",
            Schedule {
                lookups: vec![Fault::StatusWord("pending".into())],
                ..Schedule::default()
            },
        );
        create(&client, &proxy, "order-listed11").await.unwrap();
        let page = list("limit=100").await;
        let listed: Vec<&Value> = page["data"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i["metadata"]["order_id"] == "order-listed11")
            .collect();
        assert_eq!(listed[0]["status"], "pending", "{page}");
        tokio::time::sleep(Duration::from_millis(450)).await;
        let page = list("merchant_reference=order-lagging1").await;
        assert_eq!(
            page["data"].as_array().unwrap().len(),
            3,
            "past the lag: {page}"
        );
    }

    #[test]
    fn a_seed_draws_the_same_numbers() {
        let (mut a, mut b) = (SeededRng::new(7), SeededRng::new(7));
        let xs: Vec<u64> = (0..5).map(|_| a.below(600)).collect();
        let ys: Vec<u64> = (0..5).map(|_| b.below(600)).collect();
        assert_eq!(xs, ys);
        assert_ne!(SeededRng::new(8).next_u64(), SeededRng::new(7).next_u64());
    }
}
