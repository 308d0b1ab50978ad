//! The fleet test's client: `n` orders, each under its own idempotency key, sent by 16
//! workers to whichever `serve` instances are up, retried with the same key until a final
//! answer, and sent once more after it one time in four (a client that did not see the
//! answer). Every final answer is kept and compared with the key's replay at the end.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use super::super::{order, API_KEY};

/// The addresses of the `serve` instances up now; the kill loop replaces a restarted
/// instance's address.
pub(super) type Bases = Arc<Mutex<Vec<String>>>;

/// The operations and their final answers.
#[derive(Debug)]
pub(super) struct Client {
    run: String,
    n: usize,
    http: reqwest::Client,
    /// Every final answer per operation: status and body.
    answers: Mutex<Vec<Vec<(u16, Value)>>>,
    /// Operations with at least one final answer.
    pub(super) answered: AtomicUsize,
    /// Requests sent, retries included.
    pub(super) sent: AtomicUsize,
}

impl Client {
    pub(super) fn new(n: usize) -> Arc<Self> {
        Arc::new(Self {
            run: uuid::Uuid::new_v4().simple().to_string(),
            n,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap(),
            answers: Mutex::new(vec![Vec::new(); n]),
            answered: AtomicUsize::new(0),
            sent: AtomicUsize::new(0),
        })
    }

    /// The external reference of operation `i` (one order each at the end).
    pub(super) fn external_ref(&self, i: usize) -> String {
        format!("fleet-{i}-{}", self.run)
    }

    fn key(&self, i: usize) -> String {
        format!("fleet-key-{i}-{}", self.run)
    }

    /// Drives every operation to a final answer, 16 at a time.
    pub(super) async fn drive(self: Arc<Self>, bases: Bases) {
        let next = Arc::new(AtomicUsize::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..16 {
            let (me, bases, next) = (self.clone(), bases.clone(), next.clone());
            workers.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= me.n {
                        return;
                    }
                    let first = me.until_final(&bases, i, w).await;
                    me.answers.lock().unwrap()[i].push(first);
                    me.answered.fetch_add(1, Ordering::SeqCst);
                    if i % 4 == 0 {
                        let again = me.until_final(&bases, i, w + 1).await;
                        me.answers.lock().unwrap()[i].push(again);
                    }
                }
            });
        }
        while let Some(r) = workers.join_next().await {
            r.unwrap();
        }
    }

    /// Sends operation `i` until it has a final answer, moving to the next instance
    /// after each failure.
    async fn until_final(&self, bases: &Bases, i: usize, start: usize) -> (u16, Value) {
        let mut attempt = start;
        loop {
            let base = {
                let b = bases.lock().unwrap();
                b[attempt % b.len()].clone()
            };
            if let Some(answer) = self.send(&base, i).await {
                return answer;
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn send(&self, base: &str, i: usize) -> Option<(u16, Value)> {
        self.sent.fetch_add(1, Ordering::SeqCst);
        let key = self.key(i);
        let res = self
            .http
            .post(format!("{base}/v1/orders"))
            .bearer_auth(API_KEY)
            .header("idempotency-key", &key)
            .json(&order(&self.external_ref(i)))
            .send()
            .await;
        super::super::crash::drive::final_answer(res, &key).await
    }

    /// Sends every key once more, 16 at a time: each replay equals every final answer the
    /// key had. Returns the number of answers compared.
    pub(super) async fn replays_match(self: Arc<Self>, bases: Bases) -> usize {
        let next = Arc::new(AtomicUsize::new(0));
        let compared = Arc::new(AtomicUsize::new(0));
        let mut workers = tokio::task::JoinSet::new();
        for w in 0..16 {
            let (me, bases, next, compared) =
                (self.clone(), bases.clone(), next.clone(), compared.clone());
            workers.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= me.n {
                        return;
                    }
                    let replay = me.until_final(&bases, i, w).await;
                    let answers = me.answers.lock().unwrap()[i].clone();
                    assert!(!answers.is_empty(), "{}: never answered", me.key(i));
                    for a in &answers {
                        assert_eq!(
                            a,
                            &replay,
                            "{}: the client was answered differently from the final state",
                            me.key(i)
                        );
                    }
                    compared.fetch_add(answers.len(), Ordering::SeqCst);
                }
            });
        }
        while let Some(r) = workers.join_next().await {
            r.unwrap();
        }
        compared.load(Ordering::SeqCst)
    }
}
