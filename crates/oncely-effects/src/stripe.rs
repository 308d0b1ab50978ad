use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde_json::Value;

use crate::http::{self, Answer};
use crate::{
    not_found, CallOutcome, EffectRequest, ListPage, Provider, ProviderError, RemoteObject,
    StatusOutcome, StatusQuery, StatusVocabulary,
};

/// Settings of [`StripePayments`].
#[derive(Debug, Clone)]
pub struct StripeConfig {
    /// Base URL, without a trailing slash: `https://api.stripe.com` (a test-mode secret key
    /// keeps it in test mode), a `localstripe`, or `oncely sim payments`.
    pub base_url: String,
    /// The secret key (`sk_test_…` / `sk_live_…`), sent as `Authorization: Bearer`.
    pub secret_key: String,
    /// Bound on one HTTP exchange; past it the outcome is unknown. Default 30 s.
    pub timeout: Duration,
    /// The metadata key that carries the effect's reference (e.g. `invoice_id`): written on
    /// every PaymentIntent, searched and matched by the status check. Default `invoice_id`.
    pub reference_field: String,
    /// Use `GET /v1/payment_intents/search` for the status check (Stripe has it;
    /// localstripe does not). Otherwise the list is paged, newest first, down to the
    /// query's `since`. Default `true`.
    pub search: bool,
    /// How long after the latest attempt "not found" proves nothing (docs/DESIGN.md "The
    /// settle window"): the search index lags ("under a minute" normally, Stripe's search
    /// documentation), and a request the API received may commit after the caller gave up
    /// waiting, which a list cannot show yet either. Until `last send + settle_time` an
    /// empty search or list is "not yet visible"; only after it is the charge absent and
    /// sent again. Default 60 s.
    pub settle_time: Duration,
    /// The PaymentIntent's status words. Default
    /// [`StatusVocabulary::stripe_payment_intent`].
    pub intent_statuses: StatusVocabulary,
    /// The Refund's status words. Default [`StatusVocabulary::stripe_refund`].
    pub refund_statuses: StatusVocabulary,
    /// The `payment_method` of a charge whose parameters name none. Default `pm_card_visa`
    /// (Stripe's test card; set your own for live mode).
    pub default_payment_method: String,
    /// Page size of lists, 1–100. Default 100.
    pub page_limit: u8,
}

impl Default for StripeConfig {
    fn default() -> Self {
        Self {
            base_url: "https://api.stripe.com".to_owned(),
            secret_key: String::new(),
            timeout: Duration::from_secs(30),
            reference_field: "invoice_id".to_owned(),
            search: true,
            settle_time: Duration::from_secs(60),
            intent_statuses: StatusVocabulary::stripe_payment_intent(),
            refund_statuses: StatusVocabulary::stripe_refund(),
            default_payment_method: "pm_card_visa".to_owned(),
            page_limit: 100,
        }
    }
}

/// Payments on Stripe's API v1: operation `charge` creates a confirmed PaymentIntent
/// (`POST /v1/payment_intents`), operation `refund` a Refund (`POST /v1/refunds`), each
/// with the effect's key as `Idempotency-Key`.
///
/// Parameters (`EffectRequest::params`):
/// - `charge`: `amount` (integer, smallest currency unit), `currency`, optional
///   `payment_method`, optional `metadata` (an object of strings). The reference is written
///   as `metadata[<reference_field>]`.
/// - `refund`: `payment_intent` (id), optional `amount`.
///
/// Stripe v1 stores the first answer under a key, a 500 included, and replays it: a 500 —
/// replayed or not — is an unknown outcome, resolved by the status check, never taken as
/// the answer. Every answer is read through the one classifier
/// ([`oncely_core::OutcomeClass::of_status`]) and the status vocabularies: a 2xx with a
/// `processing` PaymentIntent, a word nobody listed or an unreadable body is unknown too.
#[derive(Debug, Clone)]
pub struct StripePayments {
    config: StripeConfig,
    client: reqwest::Client,
}

const NAME: &str = "payments";

impl StripePayments {
    /// An adapter with `config`.
    ///
    /// # Errors
    /// The HTTP client cannot be built (no TLS backend, bad settings).
    pub fn new(config: StripeConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder().timeout(config.timeout).build()?;
        Ok(Self { config, client })
    }

    /// The adapter's settings.
    pub fn config(&self) -> &StripeConfig {
        &self.config
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.config.base_url.trim_end_matches('/'))
    }

    fn get(&self, path: &str, query: &[(&str, &str)]) -> reqwest::RequestBuilder {
        let mut url = self.url(path);
        if !query.is_empty() {
            url.push('?');
            url.push_str(&form(query.iter().copied()));
        }
        self.client.get(url).bearer_auth(&self.config.secret_key)
    }

    fn post(&self, path: &str, key: &str, body: String) -> reqwest::RequestBuilder {
        self.client
            .post(self.url(path))
            .bearer_auth(&self.config.secret_key)
            .header("Idempotency-Key", key)
            .header("Content-Type", "application/x-www-form-urlencoded")
            .body(body)
    }

    /// The form of a `charge`, or why its parameters are unusable.
    fn charge_form(&self, request: &EffectRequest) -> Result<String, String> {
        let p = &request.params;
        let amount = p["amount"].as_i64().ok_or("params.amount: an integer")?;
        let currency = p["currency"].as_str().ok_or("params.currency: a string")?;
        let method = p["payment_method"]
            .as_str()
            .unwrap_or(&self.config.default_payment_method);
        let amount = amount.to_string();
        let mut pairs = vec![
            ("amount".to_owned(), amount),
            ("currency".to_owned(), currency.to_owned()),
            ("confirm".to_owned(), "true".to_owned()),
            ("payment_method".to_owned(), method.to_owned()),
        ];
        if let Some(meta) = p["metadata"].as_object() {
            for (k, v) in meta {
                if *k != self.config.reference_field {
                    let v = v.as_str().ok_or("params.metadata: string values")?;
                    pairs.push((format!("metadata[{k}]"), v.to_owned()));
                }
            }
        }
        pairs.push((
            format!("metadata[{}]", self.config.reference_field),
            request.reference.clone(),
        ));
        Ok(form(pairs.iter().map(|(k, v)| (k.as_str(), v.as_str()))))
    }

    async fn charge(&self, request: &EffectRequest) -> CallOutcome {
        let body = match self.charge_form(request) {
            Ok(b) => b,
            Err(reason) => return invalid(&reason),
        };
        let answer = match http::send(self.post("/v1/payment_intents", &request.key, body)).await {
            Ok(a) => a,
            Err(outcome) => return outcome,
        };
        if (200..300).contains(&answer.status) {
            let intent = answer
                .body
                .is_object()
                .then(|| self.payment_intent(&answer.body));
            return http::answered(&answer, intent);
        }
        // A declined card (402) leaves its PaymentIntent in `error.payment_intent`.
        let object = answer.body["error"]
            .get("payment_intent")
            .filter(|v| v.is_object())
            .map(|pi| self.payment_intent(pi));
        stripe_refusal(&answer, object)
    }

    async fn refund(&self, request: &EffectRequest) -> CallOutcome {
        let Some(intent) = request.params["payment_intent"].as_str() else {
            return invalid("params.payment_intent: a PaymentIntent id");
        };
        let mut pairs = vec![("payment_intent", intent.to_owned())];
        if let Some(amount) = request.params["amount"].as_i64() {
            pairs.push(("amount", amount.to_string()));
        }
        let body = form(pairs.iter().map(|(k, v)| (*k, v.as_str())));
        let answer = match http::send(self.post("/v1/refunds", &request.key, body)).await {
            Ok(a) => a,
            Err(outcome) => return outcome,
        };
        if (200..300).contains(&answer.status) {
            let refund = answer
                .body
                .is_object()
                .then(|| self.refund_object(&answer.body, &request.reference));
            return http::answered(&answer, refund);
        }
        stripe_refusal(&answer, None)
    }

    /// The charge's PaymentIntents by reference: search, or the list paged down to `since`.
    async fn charge_status(&self, query: StatusQuery<'_>) -> Result<StatusOutcome, ProviderError> {
        let reference = &query.request.reference;
        if self.config.search {
            let q = format!(
                "metadata['{}']:'{}'",
                search_escape(&self.config.reference_field),
                search_escape(reference)
            );
            let answer = http::lookup(
                NAME,
                self.get("/v1/payment_intents/search", &[("query", &q)]),
            )
            .await?;
            let found = self.intents(&answer)?;
            if !found.is_empty() {
                return Ok(StatusOutcome::Found(found));
            }
            return Ok(not_found(query.last_sent, self.config.settle_time));
        }
        let mut found = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let page = self
                .list_page("charge", query.since, cursor.as_deref())
                .await?;
            found.extend(
                page.objects
                    .into_iter()
                    .filter(|o| o.reference.as_deref() == Some(reference)),
            );
            match page.next {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        Ok(if found.is_empty() {
            not_found(query.last_sent, self.config.settle_time)
        } else {
            StatusOutcome::Found(found)
        })
    }

    async fn refund_status(&self, query: StatusQuery<'_>) -> Result<StatusOutcome, ProviderError> {
        let Some(intent) = query.request.params["payment_intent"].as_str() else {
            return Err(ProviderError::Invalid {
                provider: NAME.to_owned(),
                reason: "params.payment_intent: a PaymentIntent id".to_owned(),
            });
        };
        let limit = self.config.page_limit.clamp(1, 100).to_string();
        let answer = http::lookup(
            NAME,
            self.get(
                "/v1/refunds",
                &[("payment_intent", intent), ("limit", &limit)],
            ),
        )
        .await?;
        let found: Vec<RemoteObject> = data(&answer)?
            .iter()
            .map(|r| self.refund_object(r, &query.request.reference))
            .collect();
        Ok(if found.is_empty() {
            not_found(query.last_sent, self.config.settle_time)
        } else {
            StatusOutcome::Found(found)
        })
    }

    async fn list_page(
        &self,
        operation: &str,
        since: SystemTime,
        cursor: Option<&str>,
    ) -> Result<ListPage, ProviderError> {
        let path = match operation {
            "charge" => "/v1/payment_intents",
            "refund" => "/v1/refunds",
            other => {
                return Err(ProviderError::Invalid {
                    provider: NAME.to_owned(),
                    reason: format!("no list for operation {other:?}"),
                })
            }
        };
        let limit = self.config.page_limit.clamp(1, 100).to_string();
        let mut query = vec![("limit", limit.as_str())];
        if let Some(c) = cursor {
            query.push(("starting_after", c));
        }
        let answer = http::lookup(NAME, self.get(path, &query)).await?;
        let since = unix_secs(since);
        let mut objects = Vec::new();
        let mut older = false;
        for item in data(&answer)? {
            let object = if operation == "charge" {
                self.payment_intent(item)
            } else {
                self.refund_object(item, "")
            };
            if object.created.is_some_and(|c| c < since) {
                older = true;
                break;
            }
            objects.push(object);
        }
        let more = answer.body["has_more"].as_bool().unwrap_or(false) && !older;
        let next = objects.last().filter(|_| more).map(|o| o.id.clone());
        Ok(ListPage { objects, next })
    }

    fn refund_object(&self, r: &Value, reference: &str) -> RemoteObject {
        let status = r["status"].as_str().unwrap_or_default().to_owned();
        RemoteObject {
            id: r["id"].as_str().unwrap_or_default().to_owned(),
            state: self.config.refund_statuses.state_of(&status),
            status,
            reference: (!reference.is_empty()).then(|| reference.to_owned()),
            amount: r["amount"].as_i64(),
            currency: r["currency"].as_str().map(str::to_owned),
            created: r["created"].as_i64(),
            raw: r.clone(),
        }
    }

    fn intents(&self, answer: &Answer) -> Result<Vec<RemoteObject>, ProviderError> {
        Ok(data(answer)?
            .iter()
            .map(|pi| self.payment_intent(pi))
            .collect())
    }

    /// A PaymentIntent (an API answer's object, or an event's `data.object`) as a
    /// [`RemoteObject`]: its status read through [`StripeConfig::intent_statuses`], its
    /// reference from `metadata[<reference_field>]`. The one reading the call, the status
    /// check, the list and a webhook event share.
    pub fn payment_intent(&self, pi: &Value) -> RemoteObject {
        let status = pi["status"].as_str().unwrap_or_default().to_owned();
        RemoteObject {
            id: pi["id"].as_str().unwrap_or_default().to_owned(),
            state: self.config.intent_statuses.state_of(&status),
            status,
            reference: pi["metadata"][&self.config.reference_field]
                .as_str()
                .map(str::to_owned),
            amount: pi["amount"].as_i64(),
            currency: pi["currency"].as_str().map(str::to_owned),
            created: pi["created"].as_i64(),
            raw: pi.clone(),
        }
    }
}

impl Provider for StripePayments {
    fn name(&self) -> &str {
        NAME
    }

    fn honours_keys(&self) -> bool {
        true
    }

    fn settle_time(&self) -> Option<std::time::Duration> {
        Some(self.config.settle_time)
    }

    fn call<'a>(&'a self, request: &'a EffectRequest) -> BoxFuture<'a, CallOutcome> {
        async move {
            match request.operation.as_str() {
                "charge" => self.charge(request).await,
                "refund" => self.refund(request).await,
                other => invalid(&format!("unknown payments operation {other:?}")),
            }
        }
        .boxed()
    }

    fn status<'a>(
        &'a self,
        query: StatusQuery<'a>,
    ) -> BoxFuture<'a, Result<StatusOutcome, ProviderError>> {
        async move {
            match query.request.operation.as_str() {
                "charge" => self.charge_status(query).await,
                "refund" => self.refund_status(query).await,
                other => Err(ProviderError::Invalid {
                    provider: NAME.to_owned(),
                    reason: format!("unknown payments operation {other:?}"),
                }),
            }
        }
        .boxed()
    }

    fn list<'a>(
        &'a self,
        operation: &'a str,
        since: SystemTime,
        cursor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<ListPage, ProviderError>> {
        self.list_page(operation, since, cursor).boxed()
    }
}

/// A non-2xx Stripe answer: its `error.code` (or `error.type`) and message.
fn stripe_refusal(answer: &Answer, object: Option<RemoteObject>) -> CallOutcome {
    let error = &answer.body["error"];
    let code = error["code"]
        .as_str()
        .or_else(|| error["type"].as_str())
        .map(str::to_owned);
    let message = error["message"].as_str().unwrap_or("no message").to_owned();
    // Stripe refuses in its own shape, `{"error": {"type": …}}`; another body is an
    // intermediary's answer, or Stripe's success behind another status.
    let refuser = if error["type"].is_string() {
        http::Refuser::Provider
    } else {
        http::Refuser::Other
    };
    http::refusal(answer, refuser, code, message, object)
}

/// The `data` array of a list or search answer.
fn data(answer: &Answer) -> Result<&Vec<Value>, ProviderError> {
    answer.body["data"]
        .as_array()
        .ok_or_else(|| ProviderError::Invalid {
            provider: NAME.to_owned(),
            reason: "a list answer without a data array".to_owned(),
        })
}

/// A request this adapter refuses to send: a definitive failure of the effect's own
/// parameters (status 0: no HTTP exchange happened).
fn invalid(reason: &str) -> CallOutcome {
    CallOutcome::Failed {
        status: 0,
        code: Some("invalid_params".to_owned()),
        message: reason.to_owned(),
        object: None,
    }
}

/// `application/x-www-form-urlencoded`, as Stripe takes its parameters.
fn form<'a>(pairs: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    let mut s = form_urlencoded::Serializer::new(String::new());
    for (k, v) in pairs {
        s.append_pair(k, v);
    }
    s.finish()
}

/// A value inside a single-quoted string of Stripe's search query language.
fn search_escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\'', "\\'")
}

fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}
