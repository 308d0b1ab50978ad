//! [`ReconcileBackend`] on PostgreSQL: the portable select list.

use super::PgStore;
use crate::reconcile::ReconcileBackend;

impl ReconcileBackend for PgStore {}
