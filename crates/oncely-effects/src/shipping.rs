use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use futures_util::FutureExt;
use serde_json::{json, Value};

use crate::http;
use crate::{
    not_found, CallOutcome, EffectRequest, ListPage, ObjectState, Provider, ProviderError,
    RemoteObject, StatusOutcome, StatusQuery, StatusVocabulary,
};

/// Settings of [`ShippingClient`].
#[derive(Debug, Clone)]
pub struct ShippingConfig {
    /// Base URL, without a trailing slash (e.g. `oncely sim shipping --listen …`).
    pub base_url: String,
    /// Sent as `Authorization: Bearer` when set.
    pub api_key: Option<String>,
    /// Bound on one HTTP exchange; past it the outcome is unknown. Default 30 s.
    pub timeout: Duration,
    /// How long after the latest send "no shipment for this reference" proves nothing
    /// (docs/DESIGN.md "The settle window"). The contract has no keys: a booking the
    /// provider received may commit after the caller gave up waiting (a slow commit), and
    /// a second booking sent before it shows would be a second shipment. Until the last
    /// send plus `settle_time` not-found is "not yet visible"; only after it is the booking
    /// absent and sent again. Default 60 s: longer than the provider's own request timeout is
    /// expected to be (60 s, nginx's default `proxy_read_timeout`), past which it should
    /// have finished or dropped the request.
    pub settle_time: Duration,
    /// The shipment's status words. Default [`StatusVocabulary::shipment`].
    pub statuses: StatusVocabulary,
}

impl Default for ShippingConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8090".to_owned(),
            api_key: None,
            timeout: Duration::from_secs(30),
            settle_time: Duration::from_secs(60),
            statuses: StatusVocabulary::shipment(),
        }
    }
}

/// A client of the keyless shipping contract (docs/DESIGN.md "Provider contracts"):
/// operation `book` (`POST /v1/shipments {merchant_reference, order_id, items}`; a second
/// POST books a second shipment) and `cancel` (`POST /v1/shipments/{id}/cancel`); the
/// status by `GET /v1/shipments?merchant_reference=…`.
///
/// The provider has no idempotency keys ([`Provider::honours_keys`] is `false`): after an
/// unknown outcome nothing is re-sent before the status check has answered absent, and
/// "not found" is absent only once [`ShippingConfig::settle_time`] has passed since the
/// latest send. Status words are read through [`ShippingConfig::statuses`]: a shipment in
/// a word nobody listed is never a failure.
///
/// Parameters: `book` — `order_id` (string), `items` (`[{sku, quantity}]`); the reference
/// is the `merchant_reference`. `cancel` — `shipment_id`.
#[derive(Debug, Clone)]
pub struct ShippingClient {
    config: ShippingConfig,
    client: reqwest::Client,
}

const NAME: &str = "shipping";

impl ShippingClient {
    /// A client with `config`.
    ///
    /// # Errors
    /// The HTTP client cannot be built.
    pub fn new(config: ShippingConfig) -> Result<Self, reqwest::Error> {
        let client = reqwest::Client::builder().timeout(config.timeout).build()?;
        Ok(Self { config, client })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let url = format!("{}{path}", self.config.base_url.trim_end_matches('/'));
        let r = self.client.request(method, url);
        match &self.config.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// The status of `query`'s shipment (`book`) or of its cancellation (`cancel`).
    async fn shipment_status(
        &self,
        query: StatusQuery<'_>,
    ) -> Result<StatusOutcome, ProviderError> {
        let cancel = query.request.operation == "cancel";
        let found = self
            .shipments(Some(&query.request.reference), cancel)
            .await?;
        let found: Vec<RemoteObject> = if cancel {
            // The cancellation's object is its shipment; one still live has not shown
            // the cancel, which is then not (yet) found.
            let id = query.request.params["shipment_id"].as_str();
            found
                .into_iter()
                .filter(|o| Some(o.id.as_str()) == id && o.state != ObjectState::Pending)
                .collect()
        } else {
            found
        };
        Ok(if found.is_empty() {
            not_found(query.last_sent, self.config.settle_time)
        } else {
            StatusOutcome::Found(found)
        })
    }

    async fn book(&self, request: &EffectRequest) -> CallOutcome {
        let body = json!({
            "merchant_reference": request.reference,
            "order_id": request.params["order_id"],
            "items": request.params["items"],
        });
        let sent = self
            .request(reqwest::Method::POST, "/v1/shipments")
            .json(&body);
        self.answer(http::send(sent).await, false)
    }

    async fn cancel(&self, request: &EffectRequest) -> CallOutcome {
        let Some(id) = request.params["shipment_id"].as_str() else {
            return CallOutcome::Failed {
                status: 0,
                code: Some("invalid_params".to_owned()),
                message: "params.shipment_id: a shipment id".to_owned(),
                object: None,
            };
        };
        let sent = self.request(
            reqwest::Method::POST,
            &format!("/v1/shipments/{}/cancel", path_segment(id)),
        );
        self.answer(http::send(sent).await, true)
    }

    /// A shipment as an object of the effect: of a booking, its own state; of a
    /// cancellation, the cancellation's — live once the shipment ended, pending while the
    /// shipment is still live (the cancel has not shown), the word's own state otherwise.
    fn shipment(&self, v: &Value, cancel: bool) -> RemoteObject {
        let mut object = shipment(v);
        object.state = match (self.config.statuses.state_of(&object.status), cancel) {
            (ObjectState::Ended, true) => ObjectState::Live,
            (ObjectState::Live, true) => ObjectState::Pending,
            (state, _) => state,
        };
        object
    }

    fn answer(&self, sent: Result<http::Answer, CallOutcome>, cancel: bool) -> CallOutcome {
        let answer = match sent {
            Ok(a) => a,
            Err(outcome) => return outcome,
        };
        if (200..300).contains(&answer.status) {
            let object = answer
                .body
                .is_object()
                .then(|| self.shipment(&answer.body, cancel));
            return http::answered(&answer, object);
        }
        // Problem details (RFC 9457): the kind is the last segment of `type`.
        let code = answer.body["type"]
            .as_str()
            .and_then(|t| t.rsplit(':').next())
            .map(str::to_owned);
        let message = answer.body["detail"]
            .as_str()
            .or_else(|| answer.body["title"].as_str())
            .unwrap_or("no message")
            .to_owned();
        // The contract refuses with a problem document (RFC 9457, `type`); another body is an
        // intermediary's, or the booking behind another status. And a provider without keys
        // is never sent again on its own word alone: even its 429 is looked up first.
        let refuser = if answer.body["type"].is_string() {
            http::Refuser::Provider
        } else {
            http::Refuser::Other
        };
        match http::refusal(&answer, refuser, code, message, None) {
            CallOutcome::Retryable { status, .. } => CallOutcome::Unknown {
                status: Some(status),
                reason: format!("a {status} from a provider without keys: looked up before anything is sent again"),
            },
            outcome => outcome,
        }
    }

    async fn shipments(
        &self,
        reference: Option<&str>,
        cancel: bool,
    ) -> Result<Vec<RemoteObject>, ProviderError> {
        let mut r = self.request(reqwest::Method::GET, "/v1/shipments");
        if let Some(reference) = reference {
            r = r.query(&[("merchant_reference", reference)]);
        }
        let found = http::lookup(NAME, r).await?;
        let data = found.body["data"]
            .as_array()
            .ok_or_else(|| ProviderError::Invalid {
                provider: NAME.to_owned(),
                reason: "a list answer without a data array".to_owned(),
            })?;
        // Newest first, like every list here.
        Ok(data
            .iter()
            .rev()
            .map(|v| self.shipment(v, cancel))
            .collect())
    }
}

impl Provider for ShippingClient {
    fn name(&self) -> &str {
        NAME
    }

    fn honours_keys(&self) -> bool {
        false
    }

    fn settle_time(&self) -> Option<std::time::Duration> {
        Some(self.config.settle_time)
    }

    fn call<'a>(&'a self, request: &'a EffectRequest) -> BoxFuture<'a, CallOutcome> {
        async move {
            match request.operation.as_str() {
                "book" => self.book(request).await,
                "cancel" => self.cancel(request).await,
                other => CallOutcome::Failed {
                    status: 0,
                    code: Some("invalid_params".to_owned()),
                    message: format!("unknown shipping operation {other:?}"),
                    object: None,
                },
            }
        }
        .boxed()
    }

    fn status<'a>(
        &'a self,
        query: StatusQuery<'a>,
    ) -> BoxFuture<'a, Result<StatusOutcome, ProviderError>> {
        self.shipment_status(query).boxed()
    }

    fn list<'a>(
        &'a self,
        _operation: &'a str,
        since: SystemTime,
        _cursor: Option<&'a str>,
    ) -> BoxFuture<'a, Result<ListPage, ProviderError>> {
        async move {
            // The contract's list is not paged: one page holds the whole window.
            let since = since
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            let objects = self
                .shipments(None, false)
                .await?
                .into_iter()
                .filter(|o| o.created.is_none_or(|c| c >= since))
                .collect();
            Ok(ListPage {
                objects,
                next: None,
            })
        }
        .boxed()
    }
}

/// A shipment's fields; its state is set by [`ShippingClient::shipment`].
fn shipment(v: &Value) -> RemoteObject {
    let status = v["status"].as_str().unwrap_or_default().to_owned();
    RemoteObject {
        id: v["id"].as_str().unwrap_or_default().to_owned(),
        state: ObjectState::Unrecognised,
        status,
        reference: v["merchant_reference"].as_str().map(str::to_owned),
        amount: None,
        currency: None,
        created: v["created"].as_i64().or_else(|| v["created_at"].as_i64()),
        raw: v.clone(),
    }
}

/// `id` as one URL path segment (ids are the provider's; escape anyway).
fn path_segment(id: &str) -> String {
    form_urlencoded::byte_serialize(id.as_bytes()).collect()
}
