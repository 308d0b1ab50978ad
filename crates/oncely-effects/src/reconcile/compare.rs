//! The comparison of the provider's objects with the local intents, and the discrepancies it finds.

use std::collections::BTreeMap;

use oncely_sql::{DiscrepancyKind, NewDiscrepancy};
use serde_json::json;

use super::source::{LocalIntent, LocalStatus};
use crate::RemoteObject;

/// What comparing one reference found.
#[derive(Debug)]
pub(crate) enum Finding<'a> {
    Discrepancy(NewDiscrepancy),
    /// An unknown intent, with the records found for it (maybe none).
    Unknown(&'a LocalIntent, Vec<RemoteObject>),
}

/// Compares both sides by reference: every local intent against the records of its
/// reference, and every record against the local intents.
pub(crate) fn compare<'a>(
    provider: &str,
    local: &'a BTreeMap<String, LocalIntent>,
    remote: &[RemoteObject],
) -> Vec<Finding<'a>> {
    let mut by_reference: BTreeMap<String, Vec<RemoteObject>> = BTreeMap::new();
    for object in remote {
        // A record without a reference stands for itself, under its id.
        let key = object
            .reference
            .clone()
            .unwrap_or_else(|| object.id.clone());
        by_reference.entry(key).or_default().push(object.clone());
    }
    let mut findings = Vec::new();
    for (reference, intent) in local {
        let found = by_reference.remove(reference).unwrap_or_default();
        findings.extend(against_local(provider, intent, found));
    }
    for (reference, found) in by_reference {
        findings.push(Finding::Discrepancy(discrepancy(
            provider,
            DiscrepancyKind::MissingLocal,
            &reference,
            None,
            &found,
            None,
            "the provider has records no local intent names",
        )));
    }
    findings
}

/// Live records that name one business object (at `pointer` in their raw answers) under
/// more than one reference: one `duplicate_remote` per business object, its reference
/// `<pointer>=<value>`. Duplicates under one reference are `against_local`'s.
pub(crate) fn duplicates_by_business<'a>(
    provider: &str,
    pointer: &str,
    remote: &[RemoteObject],
) -> Vec<Finding<'a>> {
    let mut by_business: BTreeMap<String, Vec<RemoteObject>> = BTreeMap::new();
    for object in remote.iter().filter(|o| o.is_live()) {
        if let Some(value) = object.raw.pointer(pointer).and_then(|v| v.as_str()) {
            by_business
                .entry(value.to_owned())
                .or_default()
                .push(object.clone());
        }
    }
    by_business
        .into_iter()
        .filter(|(_, found)| {
            let references: std::collections::BTreeSet<_> =
                found.iter().map(|o| o.reference.as_deref()).collect();
            references.len() > 1
        })
        .map(|(value, found)| {
            Finding::Discrepancy(discrepancy(
                provider,
                DiscrepancyKind::DuplicateRemote,
                &format!("{pointer}={value}"),
                None,
                &found,
                None,
                &format!(
                    "{} live records for one business object under different references",
                    found.len()
                ),
            ))
        })
        .collect()
}

/// Sets `business_ref` in the details of `d`: the business object its provider records
/// name at `pointer` (the first of them that names one), e.g. the order id of
/// `metadata[order_id]`. Nothing when none does.
pub(crate) fn carry_business_ref(d: &mut NewDiscrepancy, pointer: &str, remote: &[RemoteObject]) {
    let value = d.provider_ids.iter().find_map(|id| {
        let object = remote.iter().find(|o| &o.id == id)?;
        object.raw.pointer(pointer)?.as_str().map(str::to_owned)
    });
    if let (Some(value), Some(details)) = (value, d.details.as_object_mut()) {
        details.insert("business_ref".to_owned(), value.into());
    }
}

pub(crate) fn against_local<'a>(
    provider: &str,
    intent: &'a LocalIntent,
    found: Vec<RemoteObject>,
) -> Vec<Finding<'a>> {
    if intent.status == LocalStatus::Unknown {
        return vec![Finding::Unknown(intent, found)];
    }
    let live: Vec<&RemoteObject> = found.iter().filter(|o| o.is_live()).collect();
    let mut out = Vec::new();
    let mut report = |kind, object: Option<&RemoteObject>, detail: String| {
        out.push(Finding::Discrepancy(discrepancy(
            provider,
            kind,
            &intent.reference,
            Some(intent),
            &found,
            object,
            &detail,
        )));
    };
    match &intent.status {
        LocalStatus::InProgress | LocalStatus::Unknown => {}
        LocalStatus::Succeeded { provider_id } => {
            let matched = match provider_id {
                Some(id) => found.iter().find(|o| &o.id == id),
                None => live.first().copied(),
            };
            match matched {
                None => report(
                    DiscrepancyKind::MissingRemote,
                    None,
                    format!(
                        "recorded as succeeded with {}, the provider has no such record",
                        provider_id.as_deref().unwrap_or("no id")
                    ),
                ),
                Some(m) if !m.is_live() => report(
                    DiscrepancyKind::StatusMismatch,
                    Some(m),
                    format!("succeeded here, {} at the provider", m.status),
                ),
                Some(m) if amounts_differ(intent, m) => report(
                    DiscrepancyKind::AmountMismatch,
                    Some(m),
                    format!(
                        "{} {} here, {} {} at the provider",
                        intent.amount.unwrap_or_default(),
                        intent.currency.as_deref().unwrap_or("?"),
                        m.amount.unwrap_or_default(),
                        m.currency.as_deref().unwrap_or("?")
                    ),
                ),
                Some(_) => {}
            }
        }
        LocalStatus::Failed | LocalStatus::NeedsReview => {
            if let Some(m) = live.first() {
                report(
                    DiscrepancyKind::StatusMismatch,
                    Some(m),
                    format!(
                        "{} here, {} {} at the provider",
                        intent.state, m.id, m.status
                    ),
                );
            }
        }
    }
    if live.len() > 1 {
        report(
            DiscrepancyKind::DuplicateRemote,
            None,
            format!(
                "{} live records at the provider for one reference",
                live.len()
            ),
        );
    }
    out
}

pub(crate) fn amounts_differ(intent: &LocalIntent, object: &RemoteObject) -> bool {
    let amount = matches!((intent.amount, object.amount), (Some(a), Some(b)) if a != b);
    let currency = matches!(
        (&intent.currency, &object.currency),
        (Some(a), Some(b)) if !a.eq_ignore_ascii_case(b)
    );
    amount || currency
}

/// A discrepancy of `kind` on `reference`: the local side from `intent`, the remote side
/// from `object` (or the first record found).
pub(crate) fn discrepancy(
    provider: &str,
    kind: DiscrepancyKind,
    reference: &str,
    intent: Option<&LocalIntent>,
    found: &[RemoteObject],
    object: Option<&RemoteObject>,
    detail: &str,
) -> NewDiscrepancy {
    let remote = object.or(found.first());
    NewDiscrepancy {
        provider: provider.to_owned(),
        kind,
        reference: reference.to_owned(),
        tenant: intent.map(|i| i.tenant.clone()),
        effect_id: intent.map(|i| i.id.clone()),
        provider_ids: found.iter().map(|o| o.id.clone()).collect(),
        details: json!({
            "detail": detail,
            "source": intent.map(|i| i.source.clone()),
            "local_status": intent.map(|i| i.state.clone()),
            "local_amount": intent.and_then(|i| i.amount),
            "local_currency": intent.and_then(|i| i.currency.clone()),
            "remote_status": remote.map(|o| o.status.clone()),
            "remote_amount": remote.and_then(|o| o.amount),
            "remote_currency": remote.and_then(|o| o.currency.clone()),
            "remote_statuses": found.iter().map(|o| json!({"id": o.id, "status": o.status})).collect::<Vec<_>>(),
        }),
    }
}
