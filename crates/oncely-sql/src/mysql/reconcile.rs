//! [`ReconcileBackend`] on MySQL / MariaDB: the binary-collated text columns (compared byte
//! for byte, as on the other backends) are reported as VARBINARY: cast back to text to
//! decode.

use super::MySqlStore;
use crate::reconcile::ReconcileBackend;

impl ReconcileBackend for MySqlStore {
    const COLUMNS: &'static str = "id, CAST(provider AS CHAR) AS provider, kind, \
        CAST(reference AS CHAR) AS reference, CAST(tenant AS CHAR) AS tenant, effect_id, \
        provider_ids, details, run_id, last_run_id, found_at, last_seen_at, resolved_at, \
        resolution, resolved_by";
}
