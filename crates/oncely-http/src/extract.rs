use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;
use oncely_core::{IdempotencyKey, Scope};
use oncely_sql::Tx;
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::Problem;

/// The slot through which the layer lends its transaction to the handler and takes it back.
#[derive(Clone)]
pub(crate) struct TxSlot(pub(crate) Arc<Mutex<Option<Tx>>>);

/// The request's idempotency key and scope, for handlers that derive ids from them (e.g.
/// message ids of events produced by the operation, so a re-execution cannot mint new ids).
#[derive(Debug, Clone)]
pub struct IdempotencyContext {
    /// Tenant and operation.
    pub scope: Scope,
    /// The caller's key; `None` when keys are optional and none was sent.
    pub key: Option<IdempotencyKey>,
}

/// The transaction in which the request's idempotency key was reserved.
///
/// Business writes made through it commit together with the idempotency record and the
/// stored response, after the handler returns — or roll back with them. Do not commit it
/// yourself (you cannot: the layer owns it). Dereferences to [`Tx`].
pub struct IdempotentTx {
    guard: OwnedMutexGuard<Option<Tx>>,
    context: Option<IdempotencyContext>,
}

impl std::fmt::Debug for IdempotentTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotentTx")
            .field("context", &self.context)
            .finish_non_exhaustive()
    }
}

impl IdempotentTx {
    /// Key and scope of this request, when it ran under [`crate::IdempotencyLayer`].
    pub fn context(&self) -> Option<&IdempotencyContext> {
        self.context.as_ref()
    }
}

impl Deref for IdempotentTx {
    type Target = Tx;
    fn deref(&self) -> &Tx {
        self.guard.as_ref().expect("checked at extraction")
    }
}

impl DerefMut for IdempotentTx {
    fn deref_mut(&mut self) -> &mut Tx {
        self.guard.as_mut().expect("checked at extraction")
    }
}

/// The handler asked for [`IdempotentTx`] on a route without the layer (a wiring error).
#[derive(Debug)]
pub struct TxRejection;

impl IntoResponse for TxRejection {
    fn into_response(self) -> Response {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            crate::problem::kind::NO_TRANSACTION,
            "The route is not wrapped by the idempotency or transaction layer",
        )
        .into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotentTx {
    type Rejection = TxRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, TxRejection> {
        let slot = parts.extensions.get::<TxSlot>().ok_or(TxRejection)?.clone();
        let guard = slot.0.lock_owned().await;
        if guard.is_none() {
            return Err(TxRejection);
        }
        Ok(Self {
            guard,
            context: parts.extensions.get::<IdempotencyContext>().cloned(),
        })
    }
}
