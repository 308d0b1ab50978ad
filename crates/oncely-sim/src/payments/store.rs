//! The in-memory account: PaymentIntents, Charges, Refunds and the idempotency records.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use http::StatusCode;
use serde::Serialize;
use serde_json::{json, Value};

use super::params::{Answer, ApiError, NewIntent, NewRefund, Params};
use super::{MetadataCount, PaymentsStats};

/// A Stripe PaymentIntent (the fields an adapter reads; API 2022-11-15+ shape with
/// `latest_charge`).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PaymentIntent {
    pub(crate) id: String,
    object: &'static str,
    pub(crate) amount: u64,
    amount_received: u64,
    capture_method: &'static str,
    client_secret: String,
    confirmation_method: &'static str,
    created: i64,
    pub(crate) currency: String,
    description: Option<String>,
    last_payment_error: Option<Value>,
    latest_charge: Option<String>,
    livemode: bool,
    pub(crate) metadata: BTreeMap<String, String>,
    payment_method: Option<String>,
    payment_method_types: [&'static str; 1],
    pub(crate) status: String,
    #[serde(skip)]
    pub(crate) born: Option<Instant>,
}

/// A Stripe Charge: where refunds show (`amount_refunded`, `refunded`).
#[allow(clippy::struct_excessive_bools)] // Stripe's shape
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Charge {
    id: String,
    object: &'static str,
    amount: u64,
    amount_captured: u64,
    amount_refunded: u64,
    captured: bool,
    created: i64,
    currency: String,
    failure_code: Option<String>,
    failure_message: Option<String>,
    livemode: bool,
    metadata: BTreeMap<String, String>,
    paid: bool,
    payment_intent: String,
    payment_method: Option<String>,
    refunded: bool,
    status: &'static str,
}

/// A Stripe Refund.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Refund {
    id: String,
    object: &'static str,
    amount: u64,
    pub(crate) charge: String,
    created: i64,
    currency: String,
    metadata: BTreeMap<String, String>,
    pub(crate) payment_intent: String,
    reason: Option<String>,
    status: &'static str,
}

/// Where a list page starts (Stripe's `starting_after` / `ending_before`).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Cursor {
    Newest,
    /// Objects older than this sequence number.
    Before(u64),
    /// Objects newer than this sequence number.
    After(u64),
}

/// One page, newest first, and whether more lie beyond it in the cursor's direction.
pub(crate) fn page<'a, T>(
    map: &'a BTreeMap<u64, T>,
    cursor: Cursor,
    limit: usize,
    keep: impl Fn(&T) -> bool,
) -> (Vec<(u64, &'a T)>, bool) {
    let pick = |it: &mut dyn Iterator<Item = (&'a u64, &'a T)>| -> Vec<(u64, &'a T)> {
        it.filter(|(_, t)| keep(t))
            .take(limit + 1)
            .map(|(s, t)| (*s, t))
            .collect()
    };
    let mut items = match cursor {
        Cursor::Newest => pick(&mut map.iter().rev()),
        Cursor::Before(s) => pick(&mut map.range(..s).rev()),
        Cursor::After(s) => pick(&mut map.range(s + 1..)),
    };
    let more = items.len() > limit;
    items.truncate(limit);
    if matches!(cursor, Cursor::After(_)) {
        items.reverse();
    }
    (items, more)
}

/// What the idempotency layer keeps per `(secret key, Idempotency-Key)`.
#[derive(Debug)]
pub(crate) struct Stored {
    path: &'static str,
    fingerprint: Vec<(String, String)>,
    pub(crate) answer: Answer,
    pub(crate) request_id: String,
}

/// The result of looking a key up.
#[derive(Debug)]
pub(crate) enum Lookup<'a> {
    New,
    Replay(&'a Stored),
    Mismatch,
}

/// Counts of effect requests, for [`PaymentsStats`].
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct RequestCounts {
    /// Requests that ran their effect (an `error_before` fault counts: it got that far).
    pub executed: u64,
    /// Answers replayed from an idempotency record.
    pub replayed: u64,
    /// `idempotency_error` answers (same key, other parameters or endpoint).
    pub idempotency_errors: u64,
}

#[derive(Debug)]
pub(crate) struct Store {
    tag: String,
    seq: u64,
    pub(crate) intents: BTreeMap<u64, PaymentIntent>,
    pub(crate) refunds: BTreeMap<u64, Refund>,
    charges: HashMap<String, Charge>,
    seq_of: HashMap<String, u64>,
    idempotency: HashMap<(String, String), Stored>,
    pub(crate) counts: RequestCounts,
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn declined(payment_method: &str) -> Option<&'static str> {
    if !payment_method.contains("chargeDeclined") {
        return None;
    }
    Some(if payment_method.contains("InsufficientFunds") {
        "insufficient_funds"
    } else {
        "generic_decline"
    })
}

impl Store {
    pub(crate) fn new() -> Self {
        // Ids embed a per-instance tag so two simulators never hand out the same id.
        let tag: String = (0..8)
            .map(|_| {
                char::from(
                    b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789"
                        [rand::random_range(0..57)],
                )
            })
            .collect();
        Self {
            tag,
            seq: 0,
            intents: BTreeMap::new(),
            refunds: BTreeMap::new(),
            charges: HashMap::new(),
            seq_of: HashMap::new(),
            idempotency: HashMap::new(),
            counts: RequestCounts::default(),
        }
    }

    /// A new id `prefix_<tag><sequence>`: unique, and sortable by creation.
    fn next_id(&mut self, prefix: &str) -> (u64, String) {
        self.seq += 1;
        (self.seq, format!("{prefix}_{}{:012}", self.tag, self.seq))
    }

    pub(crate) fn seq_of(&self, id: &str) -> Option<u64> {
        self.seq_of.get(id).copied()
    }

    pub(crate) fn intent(&self, id: &str) -> Option<&PaymentIntent> {
        self.intents.get(&self.seq_of(id)?)
    }

    pub(crate) fn refund(&self, id: &str) -> Option<&Refund> {
        self.refunds.get(&self.seq_of(id)?)
    }

    pub(crate) fn charge(&self, id: &str) -> Option<&Charge> {
        self.charges.get(id)
    }

    pub(crate) fn lookup(
        &self,
        scope: &str,
        key: &str,
        path: &'static str,
        params: &Params,
    ) -> Lookup<'_> {
        match self.idempotency.get(&(scope.to_owned(), key.to_owned())) {
            None => Lookup::New,
            Some(s) if s.path == path && s.fingerprint == params.fingerprint() => Lookup::Replay(s),
            Some(_) => Lookup::Mismatch,
        }
    }

    pub(crate) fn remember(
        &mut self,
        scope: &str,
        key: &str,
        path: &'static str,
        params: &Params,
        answer: Answer,
        request_id: String,
    ) {
        self.idempotency.insert(
            (scope.to_owned(), key.to_owned()),
            Stored {
                path,
                fingerprint: params.fingerprint(),
                answer,
                request_id,
            },
        );
    }

    /// Creates the PaymentIntent (and, when confirmed, its Charge). A payment method whose id
    /// contains `processing` (`pm_card_processing`) leaves it `processing`. A declined card leaves
    /// the intent in `requires_payment_method` with `last_payment_error`, a failed Charge,
    /// and answers 402 `card_error` carrying the intent — as Stripe does.
    pub(crate) fn create_intent(&mut self, new: NewIntent) -> Answer {
        let (seq, id) = self.next_id("pi");
        let created = unix_now();
        let mut pi = PaymentIntent {
            client_secret: format!("{id}_secret_sim"),
            id,
            object: "payment_intent",
            amount: new.amount,
            amount_received: 0,
            capture_method: "automatic",
            confirmation_method: "automatic",
            created,
            currency: new.currency,
            description: new.description,
            last_payment_error: None,
            latest_charge: None,
            livemode: false,
            metadata: new.metadata,
            payment_method: new.payment_method,
            payment_method_types: ["card"],
            status: "requires_payment_method".into(),
            born: Some(Instant::now()),
        };
        let mut decline = None;
        match (&pi.payment_method, new.confirm) {
            // A payment method that settles later (a bank debit): the intent stays
            // `processing`, nothing charged yet.
            (Some(pm), true) if pm.contains("processing") => pi.status = "processing".into(),
            (Some(pm), true) => {
                let code = declined(pm);
                let charge = self.charge_for(&pi, code);
                pi.latest_charge = Some(charge.clone());
                if let Some(code) = code {
                    let error = json!({
                        "type": "card_error", "code": "card_declined", "decline_code": code,
                        "message": "Your card was declined.", "charge": charge,
                        "payment_method": {"id": pm, "object": "payment_method", "type": "card"},
                    });
                    pi.last_payment_error = Some(error);
                    decline = Some((code, charge));
                } else {
                    pi.status = "succeeded".into();
                    pi.amount_received = pi.amount;
                }
            }
            (Some(_), false) => pi.status = "requires_confirmation".into(),
            (None, _) => {}
        }
        self.seq_of.insert(pi.id.clone(), seq);
        let body = serde_json::to_value(&pi).unwrap_or_default();
        self.intents.insert(seq, pi);
        match decline {
            None => Answer::json(StatusCode::OK, &body),
            Some((code, charge)) => ApiError::new(
                StatusCode::PAYMENT_REQUIRED,
                "card_error",
                "Your card was declined.",
            )
            .code("card_declined")
            .with("decline_code", code.into())
            .with("charge", charge.into())
            .with("payment_intent", body)
            .answer(),
        }
    }

    fn charge_for(&mut self, pi: &PaymentIntent, decline: Option<&str>) -> String {
        let (_, id) = self.next_id("ch");
        let ok = decline.is_none();
        let charge = Charge {
            id: id.clone(),
            object: "charge",
            amount: pi.amount,
            amount_captured: if ok { pi.amount } else { 0 },
            amount_refunded: 0,
            captured: ok,
            created: pi.created,
            currency: pi.currency.clone(),
            failure_code: decline.map(|_| "card_declined".into()),
            failure_message: decline.map(|_| "Your card was declined.".into()),
            livemode: false,
            metadata: pi.metadata.clone(),
            paid: ok,
            payment_intent: pi.id.clone(),
            payment_method: pi.payment_method.clone(),
            refunded: false,
            status: if ok { "succeeded" } else { "failed" },
        };
        self.charges.insert(id.clone(), charge);
        id
    }

    /// Refunds `amount` (default: what is left) of the intent's succeeded charge.
    pub(crate) fn create_refund(&mut self, new: NewRefund) -> Answer {
        match self.try_refund(new) {
            Ok(refund) => Answer::json(
                StatusCode::OK,
                &serde_json::to_value(refund).unwrap_or_default(),
            ),
            Err(e) => e.answer(),
        }
    }

    fn try_refund(&mut self, new: NewRefund) -> Result<Refund, ApiError> {
        let charge_id = match (&new.payment_intent, &new.charge) {
            (Some(pi), _) => {
                let intent = self
                    .intent(pi)
                    .ok_or_else(|| ApiError::missing("payment_intent", pi, "payment_intent"))?;
                if intent.status != "succeeded" {
                    return Err(ApiError::invalid(format!(
                        "This PaymentIntent ({pi}) does not have a successful charge to refund."
                    ))
                    .param("payment_intent"));
                }
                intent.latest_charge.clone().unwrap_or_default()
            }
            (None, Some(ch)) => ch.clone(),
            (None, None) => unreachable!("NewRefund::parse requires one of them"),
        };
        let charge = self
            .charges
            .get(&charge_id)
            .filter(|c| c.paid)
            .ok_or_else(|| ApiError::missing("charge", &charge_id, "charge"))?;
        let left = charge.amount - charge.amount_refunded;
        if left == 0 {
            return Err(ApiError::invalid(format!(
                "Charge {charge_id} has already been refunded."
            ))
            .code("charge_already_refunded"));
        }
        let amount = new.amount.unwrap_or(left);
        if amount > left {
            return Err(ApiError::invalid(format!(
                "Refund amount ({amount}) is greater than unrefunded amount on charge ({left})"
            ))
            .code("amount_too_large")
            .param("amount"));
        }
        let (currency, payment_intent) = (charge.currency.clone(), charge.payment_intent.clone());
        let (seq, id) = self.next_id("re");
        let refund = Refund {
            id: id.clone(),
            object: "refund",
            amount,
            charge: charge_id.clone(),
            created: unix_now(),
            currency,
            metadata: new.metadata,
            payment_intent,
            reason: new.reason,
            status: "succeeded",
        };
        if let Some(c) = self.charges.get_mut(&charge_id) {
            c.amount_refunded += amount;
            c.refunded = c.amount_refunded == c.amount;
        }
        self.seq_of.insert(id, seq);
        self.refunds.insert(seq, refund.clone());
        Ok(refund)
    }

    pub(crate) fn stats(&self) -> PaymentsStats {
        let mut stats = PaymentsStats {
            payment_intents: self.intents.len() as u64,
            refunds: self.refunds.len() as u64,
            requests: self.counts,
            ..PaymentsStats::default()
        };
        for pi in self.intents.values() {
            *stats
                .payment_intents_by_status
                .entry(pi.status.clone())
                .or_default() += 1;
            for (k, v) in &pi.metadata {
                let c: &mut MetadataCount = stats
                    .payment_intents_by_metadata
                    .entry(k.clone())
                    .or_default()
                    .entry(v.clone())
                    .or_default();
                c.total += 1;
                c.succeeded += u64::from(pi.status == "succeeded");
            }
        }
        for r in self.refunds.values() {
            stats.refunded_amount += r.amount;
            *stats
                .refunds_by_payment_intent
                .entry(r.payment_intent.clone())
                .or_default() += 1;
        }
        stats
    }
}
