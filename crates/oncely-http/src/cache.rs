use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncely_core::{Fingerprint, IdempotencyKey, RecordState, Scope, StoredResponse};
use oncely_sql::Record;

/// A finished, committed outcome: immutable until its record expires.
#[derive(Debug)]
pub(crate) struct Settled {
    pub(crate) state: RecordState,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) response: StoredResponse,
    /// Unix ms; never served at or after this instant.
    pub(crate) expires_at: i64,
}

impl Settled {
    /// The outcome `response`, stored at `now_ms` (Unix ms) for a request with
    /// `fingerprint`, kept as long as its record (`retention`).
    pub(crate) fn new(
        fingerprint: Fingerprint,
        response: StoredResponse,
        now_ms: i64,
        retention: Duration,
    ) -> Self {
        let retention_ms = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
        Self {
            state: RecordState::for_status(response.status),
            fingerprint,
            response,
            expires_at: now_ms.saturating_add(retention_ms),
        }
    }
}

type CacheKey = (String, String, String);

/// Per-process cache of finished outcomes, bounded in bytes, first-in first-out.
///
/// Only committed records in a final state enter it, and a final record never changes
/// until it expires, so a hit is the same answer the store would give — without a database
/// round trip. The fingerprint is still compared on a hit. Keys include the tenant, so a
/// hit can never cross tenants. A hand-written FIFO rather than an LRU crate: the bound is
/// in bytes of stored responses, which common LRU crates count in entries.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity_bytes: usize,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<CacheKey, Arc<Settled>>,
    order: VecDeque<CacheKey>,
    bytes: usize,
}

fn cache_key(scope: &Scope, key: &IdempotencyKey) -> CacheKey {
    (
        scope.tenant.as_str().to_owned(),
        scope.operation.as_str().to_owned(),
        key.as_str().to_owned(),
    )
}

fn weight(k: &CacheKey, s: &Settled) -> usize {
    k.0.len() + k.1.len() + k.2.len() + s.response.body.len() + 128
}

impl ReplayCache {
    pub(crate) fn new(capacity_bytes: usize) -> Self {
        Self {
            capacity_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    pub(crate) fn get(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Option<Arc<Settled>> {
        if self.capacity_bytes == 0 {
            return None;
        }
        let inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        inner
            .map
            .get(&cache_key(scope, key))
            .filter(|s| now_ms < s.expires_at)
            .cloned()
    }

    pub(crate) fn insert(&self, scope: &Scope, key: &IdempotencyKey, settled: Settled) {
        if !settled.state.is_final() {
            return;
        }
        let k = cache_key(scope, key);
        let w = weight(&k, &settled);
        if w > self.capacity_bytes / 4 {
            return;
        }
        let mut inner = self
            .inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if inner.map.contains_key(&k) {
            return;
        }
        while inner.bytes + w > self.capacity_bytes {
            let Some(old) = inner.order.pop_front() else {
                break;
            };
            if let Some(s) = inner.map.remove(&old) {
                inner.bytes -= weight(&old, &s);
            }
        }
        inner.bytes += w;
        inner.order.push_back(k.clone());
        inner.map.insert(k, Arc::new(settled));
    }

    /// Keeps a finished record's outcome (until the record expires).
    pub(crate) fn remember(&self, scope: &Scope, key: &IdempotencyKey, record: &Record) {
        if let (Some(response), Some(expires_at)) = (&record.response, record.expires_at) {
            self.insert(
                scope,
                key,
                Settled {
                    state: record.state,
                    fingerprint: record.fingerprint,
                    response: response.clone(),
                    expires_at,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncely_core::{Operation, TenantId};

    fn scope(t: &str) -> Scope {
        Scope::new(TenantId::parse(t).unwrap(), Operation::new("POST", "/x"))
    }

    fn settled(body: usize, expires_at: i64) -> Settled {
        Settled {
            state: RecordState::Succeeded,
            fingerprint: Fingerprint::from_digests([0; 32], [0; 32]),
            response: StoredResponse::new(201, [], vec![0; body]),
            expires_at,
        }
    }

    #[test]
    fn hits_are_per_tenant_and_expire() {
        let c = ReplayCache::new(1 << 20);
        let k = IdempotencyKey::parse(b"k").unwrap();
        c.insert(&scope("a"), &k, settled(10, 100));
        assert!(c.get(&scope("a"), &k, 99).is_some());
        assert!(c.get(&scope("b"), &k, 99).is_none(), "never across tenants");
        assert!(
            c.get(&scope("a"), &k, 100).is_none(),
            "never past expires_at"
        );
    }

    #[test]
    fn the_byte_bound_evicts_oldest_first() {
        let c = ReplayCache::new(4000);
        for i in 0..10 {
            let k = IdempotencyKey::parse(format!("k{i}").as_bytes()).unwrap();
            c.insert(&scope("a"), &k, settled(800, i64::MAX));
        }
        let inner = c.inner.lock().unwrap();
        assert!(inner.bytes <= 4000);
        assert!(!inner
            .map
            .contains_key(&("a".into(), "POST /x".into(), "k0".into())));
        assert!(inner
            .map
            .contains_key(&("a".into(), "POST /x".into(), "k9".into())));
    }

    #[test]
    fn disabled_cache_never_hits() {
        let c = ReplayCache::new(0);
        let k = IdempotencyKey::parse(b"k").unwrap();
        c.insert(&scope("a"), &k, settled(1, i64::MAX));
        assert!(c.get(&scope("a"), &k, 0).is_none());
    }
}
