//! The crash tests' client: each operation has its own idempotency key and is retried
//! with it until it has a final answer; every final answer is kept, to be compared with
//! the replay of its key at the end.

use std::time::{Duration, Instant};

use serde_json::Value;

use super::super::{order, API_KEY};
use super::Flow;

/// One operation: its key, what it posts, and its final answers so far.
#[derive(Debug)]
struct Op {
    key: String,
    external_ref: String,
    /// The order to pay (payment operations only), once created.
    order: Option<String>,
    /// Every final answer: status and body.
    answers: Vec<(u16, Value)>,
}

/// The client of a scenario: `n` orders, and in [`Flow::Payment`] a payment of each.
#[derive(Debug)]
pub(super) struct Client {
    flow: Flow,
    http: reqwest::Client,
    orders: Vec<Op>,
    payments: Vec<Op>,
}

impl Client {
    pub(super) fn new(flow: Flow, n: usize) -> Self {
        let run = uuid::Uuid::new_v4().simple().to_string();
        let op = |kind: &str, i: usize| Op {
            key: format!("crash-{kind}-{i}-{run}"),
            external_ref: format!("crash-{i}-{run}"),
            order: None,
            answers: Vec::new(),
        };
        let payments = if flow == Flow::Payment {
            (0..n).map(|i| op("pay", i)).collect()
        } else {
            Vec::new()
        };
        Self {
            flow,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
            orders: (0..n).map(|i| op("order", i)).collect(),
            payments,
        }
    }

    /// The external references of the orders (one order each at the end).
    pub(super) fn external_refs(&self) -> impl Iterator<Item = &str> {
        self.orders.iter().map(|o| o.external_ref.as_str())
    }

    /// The order ids the client was answered with.
    pub(super) fn order_ids(&self) -> Vec<String> {
        self.orders
            .iter()
            .filter_map(|o| o.answers.first())
            .filter_map(|(_, b)| b["id"].as_str().map(str::to_owned))
            .collect()
    }

    /// `true` when this flow pays through the endpoint.
    pub(super) fn pays(&self) -> bool {
        self.flow == Flow::Payment
    }

    /// Sends every operation without a final answer once to `base`; connection errors
    /// and answers that are not final are left for the next round.
    pub(super) async fn drive_once(&mut self, base: &str) {
        for i in 0..self.orders.len() {
            if self.orders[i].answers.is_empty() {
                if let Some(answer) = self.send_order(base, i).await {
                    self.orders[i].answers.push(answer);
                }
            }
        }
        for i in 0..self.payments.len() {
            if self.payments[i].answers.is_empty() {
                if let Some(answer) = self.send_payment(base, i).await {
                    self.payments[i].answers.push(answer);
                }
            }
        }
    }

    /// Drives every operation to a final answer on `base`, within `bound`.
    pub(super) async fn drive(&mut self, base: &str, bound: Duration) {
        let deadline = Instant::now() + bound;
        loop {
            self.drive_once(base).await;
            let open: Vec<&str> = self
                .orders
                .iter()
                .chain(&self.payments)
                .filter(|o| o.answers.is_empty())
                .map(|o| o.key.as_str())
                .collect();
            if open.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no final answer within {bound:?} for {open:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Sends each key once more: every replay is the same as every final answer the key
    /// had (status and body), and says it is a replay.
    pub(super) async fn replays_match(&mut self, base: &str) {
        for i in 0..self.orders.len() {
            let replay = self.send_order(base, i).await;
            same(&self.orders[i], replay);
        }
        for i in 0..self.payments.len() {
            let replay = self.send_payment(base, i).await;
            same(&self.payments[i], replay);
        }
    }

    async fn send_order(&self, base: &str, i: usize) -> Option<(u16, Value)> {
        let op = &self.orders[i];
        let res = self
            .http
            .post(format!("{base}/v1/orders"))
            .bearer_auth(API_KEY)
            .header("idempotency-key", &op.key)
            .json(&order(&op.external_ref))
            .send()
            .await;
        final_answer(res, &op.key).await
    }

    async fn send_payment(&mut self, base: &str, i: usize) -> Option<(u16, Value)> {
        let order = if let Some(id) = &self.payments[i].order {
            id.clone()
        } else {
            let id = self.orders[i].answers.first()?.1["id"].as_str()?.to_owned();
            self.payments[i].order = Some(id.clone());
            id
        };
        let op = &self.payments[i];
        let res = self
            .http
            .post(format!("{base}/v1/orders/{order}/payments"))
            .bearer_auth(API_KEY)
            .header("idempotency-key", &op.key)
            .header("content-type", "application/json")
            .body("{}")
            .send()
            .await;
        final_answer(res, &op.key).await
    }
}

/// A final answer (2xx, or a 4xx that is not "in flight" or "too many"), or `None` for a
/// connection error, a 409/429 or a 5xx: the same key is sent again. Any other 4xx fails
/// the test: nothing in the reference flow is refused.
pub(in super::super) async fn final_answer(
    res: reqwest::Result<reqwest::Response>,
    key: &str,
) -> Option<(u16, Value)> {
    let res = res.ok()?;
    let status = res.status().as_u16();
    let body: Value = res.json().await.unwrap_or(Value::Null);
    match status {
        200..=299 => Some((status, body)),
        409 | 429 | 500..=599 => None,
        _ => panic!("{key}: unexpected {status} {body}"),
    }
}

fn same(op: &Op, replay: Option<(u16, Value)>) {
    let replay = replay.unwrap_or_else(|| panic!("{}: no final replay", op.key));
    for answer in &op.answers {
        assert_eq!(
            answer, &replay,
            "{}: the client was answered differently from the final state",
            op.key
        );
    }
}
