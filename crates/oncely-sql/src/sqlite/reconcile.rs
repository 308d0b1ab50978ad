//! [`ReconcileBackend`] on SQLite: the portable select list.

use super::SqliteStore;
use crate::reconcile::ReconcileBackend;

impl ReconcileBackend for SqliteStore {}
