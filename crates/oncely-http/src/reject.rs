//! Extractors whose rejections leave the key free: [`Json`], [`Path`], [`Query`] and, for
//! any other extractor, [`Unstored`]. Their [`Rejection`] is marked [`NotStored`], so a
//! request refused before its handler ran is not stored under its key and the corrected
//! retry with the same key runs.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::problem::kind;
use crate::{NotStored, Problem};

/// The answer of an extractor of this module that refused the request: a problem (or, for
/// [`Unstored`], the wrapped extractor's own answer) marked [`NotStored`], so the layer
/// stores nothing and the key stays free for the corrected retry.
///
/// Opting out: take `Result<Json<T>, Rejection>` in the handler and answer
/// [`Rejection::stored`], and the refusal is stored and replayed like any answer of the
/// handler. (axum's own extractors are stored too: their rejections carry no mark.)
#[derive(Debug)]
pub struct Rejection {
    response: Response,
    stored: bool,
}

impl Rejection {
    /// A problem of `status` and `kind`; `detail` never echoes request values.
    fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Self {
        Self {
            response: Problem::new(status, kind, title)
                .detail(detail)
                .into_response(),
            stored: false,
        }
    }

    /// The same answer without the [`NotStored`] mark: the layer stores it under the key
    /// and replays it to every retry with that key, as it does a handler's answer.
    #[must_use]
    pub fn stored(mut self) -> Self {
        self.stored = true;
        self
    }

    /// The HTTP status of the answer (400, 415, 422, …).
    pub fn status(&self) -> StatusCode {
        self.response.status()
    }
}

impl IntoResponse for Rejection {
    fn into_response(self) -> Response {
        let mut res = self.response;
        if !self.stored {
            res.extensions_mut().insert(NotStored);
        }
        res
    }
}

impl From<JsonRejection> for Rejection {
    fn from(e: JsonRejection) -> Self {
        // serde's messages quote the offending input; problem details never echo values.
        match e {
            JsonRejection::MissingJsonContentType(_) => Self::problem(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                kind::UNSUPPORTED_MEDIA_TYPE,
                "The body must be sent as application/json",
                "set Content-Type: application/json",
            ),
            JsonRejection::JsonSyntaxError(_) => Self::problem(
                StatusCode::BAD_REQUEST,
                kind::MALFORMED_JSON,
                "The request body is not valid JSON",
                "the body does not parse as JSON",
            ),
            JsonRejection::JsonDataError(_) => Self::problem(
                StatusCode::UNPROCESSABLE_ENTITY,
                kind::INVALID_BODY,
                "The request body does not match the operation's schema",
                "a field is missing or unknown, or a value has the wrong type",
            ),
            other => Self::problem(
                other.status(),
                kind::REQUEST_BODY,
                "The request body could not be read",
                "nothing was stored; retry with the same key",
            ),
        }
    }
}

impl From<PathRejection> for Rejection {
    fn from(e: PathRejection) -> Self {
        Self::problem(
            e.status(),
            kind::INVALID_PATH,
            "The path parameters are invalid",
            "a path segment does not have the form this route takes",
        )
    }
}

impl From<QueryRejection> for Rejection {
    fn from(e: QueryRejection) -> Self {
        Self::problem(
            e.status(),
            kind::INVALID_QUERY,
            "The query parameters are invalid",
            "a parameter is missing or unknown, or a value has the wrong type",
        )
    }
}

/// axum's [`axum::Json`] with a [`Rejection`] that leaves the key free: a body that is not
/// JSON (400 `malformed-json`), not `application/json` (415 `unsupported-media-type`) or not
/// of the shape `T` (422 `invalid-body`) is refused before the handler runs and stored
/// nowhere. As a response it is axum's `Json`: `T` serialised, `application/json`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Rejection> {
        let axum::Json(value) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(value))
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// axum's [`axum::extract::Path`] with a [`Rejection`] that leaves the key free (400
/// `invalid-path`, stored nowhere).
#[derive(Debug, Clone, Copy, Default)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Rejection> {
        let axum::extract::Path(value) =
            axum::extract::Path::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// axum's [`axum::extract::Query`] with a [`Rejection`] that leaves the key free (400
/// `invalid-query`, stored nowhere).
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Rejection> {
        let axum::extract::Query(value) =
            axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// Any other extractor `E` (e.g. axum's `Form`, a typed header) whose rejection leaves the
/// key free: `E`'s own answer, marked [`NotStored`].
#[derive(Debug, Clone, Copy, Default)]
pub struct Unstored<E>(pub E);

impl<E, S> FromRequestParts<S> for Unstored<E>
where
    E: FromRequestParts<S>,
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Rejection> {
        E::from_request_parts(parts, state)
            .await
            .map(Self)
            .map_err(unstored)
    }
}

impl<E, S> FromRequest<S> for Unstored<E>
where
    E: FromRequest<S>,
    S: Send + Sync,
{
    type Rejection = Rejection;

    async fn from_request(req: Request, state: &S) -> Result<Self, Rejection> {
        E::from_request(req, state)
            .await
            .map(Self)
            .map_err(unstored)
    }
}

fn unstored(rejection: impl IntoResponse) -> Rejection {
    Rejection {
        response: rejection.into_response(),
        stored: false,
    }
}
