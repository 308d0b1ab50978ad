//! The per-process cache of finished outcomes ([`ReplayCache`]), on moka.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::policy::{EvictionPolicy, Expiry};
use moka::sync::Cache;
use oncely_core::{now_ms, Fingerprint, IdempotencyKey, RecordState, Scope, StoredResponse};
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

/// Tenant, operation and key.
type CacheKey = (String, String, String);

/// Per-process cache of finished outcomes, bounded in bytes, least recently used out first.
///
/// Only committed records in a final state enter it, and a final record never changes
/// until it expires, so a hit is the same answer the store would give — without a database
/// round trip. The fingerprint is still compared on a hit. Keys include the tenant, so a
/// hit can never cross tenants. A moka cache: each entry weighs its bytes (key, stored body
/// and a fixed overhead) against `replay_cache_bytes`, and expires at its record's
/// `expires_at`.
pub(crate) struct ReplayCache {
    capacity_bytes: usize,
    /// `None` when the capacity is 0 (disabled).
    entries: Option<Cache<CacheKey, Arc<Settled>>>,
}

/// The bound and the size, not the entries: a layer's `Debug` never prints stored answers.
impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (entries, bytes) = self
            .entries
            .as_ref()
            .map_or((0, 0), |c| (c.entry_count(), c.weighted_size()));
        f.debug_struct("ReplayCache")
            .field("capacity_bytes", &self.capacity_bytes)
            .field("entries", &entries)
            .field("bytes", &bytes)
            .finish()
    }
}

fn cache_key(scope: &Scope, key: &IdempotencyKey) -> CacheKey {
    (
        scope.tenant.as_str().to_owned(),
        scope.operation.as_str().to_owned(),
        key.as_str().to_owned(),
    )
}

/// An entry's weight in bytes.
fn weight(k: &CacheKey, s: &Settled) -> usize {
    k.0.len() + k.1.len() + k.2.len() + s.response.body.len() + 128
}

/// Each entry lives until its record's `expires_at` (wall clock, Unix ms).
struct UntilExpiry;

impl Expiry<CacheKey, Arc<Settled>> for UntilExpiry {
    fn expire_after_create(
        &self,
        _key: &CacheKey,
        value: &Arc<Settled>,
        _created_at: Instant,
    ) -> Option<Duration> {
        let left_ms = value.expires_at.saturating_sub(now_ms()).max(0);
        Some(Duration::from_millis(u64::try_from(left_ms).unwrap_or(0)))
    }
}

impl ReplayCache {
    /// A cache of at most `capacity_bytes` bytes of entries (0 disables it).
    pub(crate) fn new(capacity_bytes: usize) -> Self {
        let entries = (capacity_bytes > 0).then(|| {
            Cache::builder()
                .max_capacity(u64::try_from(capacity_bytes).unwrap_or(u64::MAX))
                .weigher(|k: &CacheKey, s: &Arc<Settled>| {
                    u32::try_from(weight(k, s)).unwrap_or(u32::MAX)
                })
                .eviction_policy(EvictionPolicy::lru())
                .expire_after(UntilExpiry)
                .build()
        });
        Self {
            capacity_bytes,
            entries,
        }
    }

    /// The outcome cached for `key` in `scope`, unless it has expired at `now_ms`.
    pub(crate) fn get(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        now_ms: i64,
    ) -> Option<Arc<Settled>> {
        self.entries
            .as_ref()?
            .get(&cache_key(scope, key))
            .filter(|s| now_ms < s.expires_at)
    }

    /// Caches `settled` for `key` in `scope` when it is final, weighs at most a quarter of
    /// the capacity and is not cached yet.
    pub(crate) fn insert(&self, scope: &Scope, key: &IdempotencyKey, settled: Settled) {
        let Some(entries) = &self.entries else {
            return;
        };
        if !settled.state.is_final() {
            return;
        }
        let k = cache_key(scope, key);
        if weight(&k, &settled) > self.capacity_bytes / 4 {
            return;
        }
        entries.entry(k).or_insert_with(|| Arc::new(settled));
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
        let later = now_ms() + 60_000;
        c.insert(&scope("a"), &k, settled(10, later));
        assert!(c.get(&scope("a"), &k, later - 1).is_some());
        assert!(
            c.get(&scope("b"), &k, later - 1).is_none(),
            "never across tenants"
        );
        assert!(
            c.get(&scope("a"), &k, later).is_none(),
            "never past expires_at"
        );
    }

    #[test]
    fn the_byte_bound_evicts_oldest_first() {
        let c = ReplayCache::new(4000);
        let key = |i: i32| IdempotencyKey::parse(format!("k{i}").as_bytes()).unwrap();
        for i in 0..10 {
            c.insert(&scope("a"), &key(i), settled(800, i64::MAX));
            c.entries.as_ref().unwrap().run_pending_tasks();
        }
        let entries = c.entries.as_ref().unwrap();
        assert!(entries.weighted_size() <= 4000);
        assert!(c.get(&scope("a"), &key(0), 0).is_none());
        assert!(c.get(&scope("a"), &key(9), 0).is_some());
    }

    #[test]
    fn disabled_cache_never_hits() {
        let c = ReplayCache::new(0);
        let k = IdempotencyKey::parse(b"k").unwrap();
        c.insert(&scope("a"), &k, settled(1, i64::MAX));
        assert!(c.get(&scope("a"), &k, 0).is_none());
    }

    #[test]
    fn an_entry_leaves_the_cache_at_its_expiry() {
        let c = ReplayCache::new(1 << 20);
        let k = IdempotencyKey::parse(b"k").unwrap();
        c.insert(&scope("a"), &k, settled(10, now_ms() - 1));
        let entries = c.entries.as_ref().unwrap();
        entries.run_pending_tasks();
        assert!(!entries.contains_key(&cache_key(&scope("a"), &k)));
    }
}
