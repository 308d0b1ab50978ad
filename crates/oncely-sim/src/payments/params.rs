//! Form parameters, Stripe's error shape and the validation of each effect's input.

use std::collections::BTreeMap;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};

/// A stored or sent answer: status and the exact body bytes (replayed byte for byte).
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) body: Bytes,
}

impl Answer {
    pub(crate) fn json(status: StatusCode, value: &Value) -> Self {
        Self {
            status,
            body: Bytes::from(serde_json::to_vec(value).unwrap_or_default()),
        }
    }
}

/// An error in Stripe's shape: `{"error":{"type","code","message","param"}}`, absent
/// members omitted as Stripe does.
#[derive(Debug, Clone)]
pub(crate) struct ApiError {
    status: StatusCode,
    error: serde_json::Map<String, Value>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        let mut error = serde_json::Map::new();
        error.insert("type".into(), kind.into());
        error.insert("message".into(), message.into().into());
        Self { status, error }
    }

    /// The same error answered with `status` (kept when it is not a valid status code).
    pub(crate) fn status(mut self, status: u16) -> Self {
        if let Ok(s) = StatusCode::from_u16(status) {
            self.status = s;
        }
        self
    }

    /// 400 `invalid_request_error`.
    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 404 `resource_missing` for `param`.
    pub(crate) fn missing(object: &str, id: &str, param: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("No such {object}: '{id}'"),
        )
        .code("resource_missing")
        .param(param)
    }

    /// 500 `api_error`, what the `error_before`/`error_after` faults answer.
    pub(crate) fn api() -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "api_error",
            "An unknown error occurred",
        )
    }

    pub(crate) fn code(mut self, code: &str) -> Self {
        self.error.insert("code".into(), code.into());
        self
    }

    pub(crate) fn param(mut self, param: &str) -> Self {
        self.error.insert("param".into(), param.into());
        self
    }

    pub(crate) fn with(mut self, name: &str, value: Value) -> Self {
        self.error.insert(name.into(), value);
        self
    }

    pub(crate) fn answer(&self) -> Answer {
        Answer::json(self.status, &json!({ "error": self.error }))
    }
}

/// Form-encoded (or query) parameters in their order, as Stripe's `a[b]=c` names.
#[derive(Debug, Clone)]
pub(crate) struct Params(Vec<(String, String)>);

impl Params {
    pub(crate) fn parse(bytes: &[u8]) -> Self {
        Self(
            form_urlencoded::parse(bytes)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        )
    }

    /// The last value of `name` (a repeated scalar parameter: the last wins).
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// What the idempotency layer compares: the parameters, order-insensitive.
    pub(crate) fn fingerprint(&self) -> Vec<(String, String)> {
        let mut pairs = self.0.clone();
        pairs.sort();
        pairs
    }

    /// Refuses a parameter that is neither one of `names` nor under one of the `nested`
    /// prefixes (`metadata` accepts `metadata[k]`), as Stripe does.
    pub(crate) fn only(&self, names: &[&str], nested: &[&str]) -> Result<(), ApiError> {
        for (k, _) in &self.0 {
            let root = k.split('[').next().unwrap_or(k);
            let ok = if k.contains('[') {
                nested.contains(&root)
            } else {
                names.contains(&root)
            };
            if !ok {
                return Err(
                    ApiError::invalid(format!("Received unknown parameter: {k}"))
                        .code("parameter_unknown")
                        .param(k),
                );
            }
        }
        Ok(())
    }

    /// `metadata[k]=v` pairs; an empty value unsets the key (Stripe). At most 50 keys, keys
    /// up to 40 characters without brackets, values up to 500 characters.
    pub(crate) fn metadata(&self) -> Result<BTreeMap<String, String>, ApiError> {
        let mut out = BTreeMap::new();
        for (k, v) in &self.0 {
            let Some(key) = k
                .strip_prefix("metadata[")
                .and_then(|r| r.strip_suffix(']'))
            else {
                continue;
            };
            if key.is_empty() || key.chars().count() > 40 || key.contains(['[', ']']) {
                return Err(ApiError::invalid(format!("Invalid metadata key: {k}")).param(k));
            }
            if v.chars().count() > 500 {
                return Err(
                    ApiError::invalid("Metadata values can have up to 500 characters").param(k),
                );
            }
            if v.is_empty() {
                out.remove(key);
            } else {
                out.insert(key.to_owned(), v.clone());
            }
        }
        if out.len() > 50 {
            return Err(ApiError::invalid("Metadata can have up to 50 keys").param("metadata"));
        }
        Ok(out)
    }

    /// A positive integer parameter (amounts in the currency's smallest unit).
    pub(crate) fn positive(&self, name: &str) -> Result<Option<u64>, ApiError> {
        let Some(raw) = self.get(name) else {
            return Ok(None);
        };
        match raw.parse::<u64>() {
            Ok(n) if n >= 1 => Ok(Some(n)),
            Ok(_) => Err(
                ApiError::invalid("This value must be greater than or equal to 1.")
                    .code("parameter_invalid_integer")
                    .param(name),
            ),
            Err(_) => Err(ApiError::invalid(format!("Invalid integer: {raw}"))
                .code("parameter_invalid_integer")
                .param(name)),
        }
    }

    pub(crate) fn required<'a>(&'a self, name: &str) -> Result<&'a str, ApiError> {
        self.get(name).filter(|v| !v.is_empty()).ok_or_else(|| {
            ApiError::invalid(format!("Missing required param: {name}."))
                .code("parameter_missing")
                .param(name)
        })
    }

    pub(crate) fn boolean(&self, name: &str) -> Result<bool, ApiError> {
        match self.get(name) {
            None | Some("false") => Ok(false),
            Some("true") => Ok(true),
            Some(other) => Err(ApiError::invalid(format!("Invalid boolean: {other}"))
                .code("parameter_invalid_boolean")
                .param(name)),
        }
    }

    /// `limit`: 1–100, default 10 (Stripe's list and search pagination).
    pub(crate) fn limit(&self) -> Result<usize, ApiError> {
        let Some(raw) = self.get("limit") else {
            return Ok(10);
        };
        match raw.parse::<usize>() {
            Ok(n) if (1..=100).contains(&n) => Ok(n),
            _ => Err(ApiError::invalid(
                "This value must be greater than or equal to 1 and less than or equal to 100.",
            )
            .code("parameter_invalid_integer")
            .param("limit")),
        }
    }
}

/// `POST /v1/payment_intents`, validated.
#[derive(Debug)]
pub(crate) struct NewIntent {
    pub(crate) amount: u64,
    pub(crate) currency: String,
    pub(crate) confirm: bool,
    pub(crate) payment_method: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) metadata: BTreeMap<String, String>,
}

impl NewIntent {
    /// Validation errors are answered and not stored under a key (Stripe saves results
    /// only once an endpoint began executing).
    pub(crate) fn parse(p: &Params) -> Result<Self, ApiError> {
        p.only(
            &[
                "amount",
                "currency",
                "confirm",
                "payment_method",
                "description",
                "customer",
                "receipt_email",
                "return_url",
                "off_session",
                "capture_method",
                "confirmation_method",
                "statement_descriptor",
                "statement_descriptor_suffix",
                "setup_future_usage",
            ],
            &[
                "metadata",
                "payment_method_types",
                "automatic_payment_methods",
                "expand",
            ],
        )?;
        let amount = p.positive("amount")?.ok_or_else(|| {
            ApiError::invalid("Missing required param: amount.")
                .code("parameter_missing")
                .param("amount")
        })?;
        let currency = p.required("currency")?.to_ascii_lowercase();
        if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
            return Err(
                ApiError::invalid(format!("Invalid currency: {currency}.")).param("currency")
            );
        }
        let confirm = p.boolean("confirm")?;
        let payment_method = p
            .get("payment_method")
            .filter(|v| !v.is_empty())
            .map(str::to_owned);
        if confirm && payment_method.is_none() {
            return Err(ApiError::invalid(
                "You cannot confirm this PaymentIntent because it's missing a payment method.",
            )
            .code("payment_intent_unexpected_state"));
        }
        Ok(Self {
            amount,
            currency,
            confirm,
            payment_method,
            description: p.get("description").map(str::to_owned),
            metadata: p.metadata()?,
        })
    }
}

/// `POST /v1/refunds`, validated: `payment_intent` or `charge`, optional `amount`.
#[derive(Debug)]
pub(crate) struct NewRefund {
    pub(crate) payment_intent: Option<String>,
    pub(crate) charge: Option<String>,
    pub(crate) amount: Option<u64>,
    pub(crate) reason: Option<String>,
    pub(crate) metadata: BTreeMap<String, String>,
}

impl NewRefund {
    pub(crate) fn parse(p: &Params) -> Result<Self, ApiError> {
        p.only(
            &["payment_intent", "charge", "amount", "reason"],
            &["metadata", "expand"],
        )?;
        let payment_intent = p.get("payment_intent").map(str::to_owned);
        let charge = p.get("charge").map(str::to_owned);
        if payment_intent.is_none() && charge.is_none() {
            return Err(ApiError::invalid(
                "One of the following params should be provided for this request: payment_intent or charge.",
            )
            .code("parameter_missing")
            .param("payment_intent"));
        }
        let reason = p.get("reason").map(str::to_owned);
        if let Some(r) = &reason {
            if !["duplicate", "fraudulent", "requested_by_customer"].contains(&r.as_str()) {
                return Err(ApiError::invalid(format!("Invalid reason: {r}")).param("reason"));
            }
        }
        Ok(Self {
            payment_intent,
            charge,
            amount: p.positive("amount")?,
            reason,
            metadata: p.metadata()?,
        })
    }
}

/// A validated effect request.
#[derive(Debug)]
pub(crate) enum EffectRequest {
    Intent(NewIntent),
    Refund(NewRefund),
}
