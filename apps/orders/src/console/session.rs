//! The console's sign-in session and CSRF token, both keyed by the admin token
//! (HMAC-SHA-256, RFC 2104), so any instance of the service checks them and rotating the
//! token ends every session. Sign-out is server-side: the cookie's nonce is recorded in
//! `console_revoked_sessions` until the cookie's expiry, and a revoked cookie is refused.
//!
//! - Session cookie `oncely_console` = `<expiry ms>.<actor, base64url>.<nonce>.<MAC>`, the
//!   MAC over `session|<expiry>|<actor>|<nonce>`; `HttpOnly; SameSite=Strict; Path=/console`.
//! - CSRF token = base64url(MAC over `csrf|<cookie value>`): bound to the session, sent in
//!   every form as the hidden field `csrf` (the synchronizer-token pattern of OWASP's CSRF
//!   cheat sheet, stateless). A cross-site form cannot read it, and SameSite=Strict keeps
//!   the cookie off cross-site requests besides.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use hmac::{Hmac, Mac};
use oncely_sql::{query, Database, StoreError};
use sha2::Sha256;

/// Name of the session cookie.
pub(crate) const COOKIE: &str = "oncely_console";
/// How long a sign-in lasts, in ms (8 hours: one working shift).
pub(crate) const SESSION_MS: i64 = 8 * 3600 * 1000;

type HmacSha256 = Hmac<Sha256>;

/// The admin token and the keyed MACs made from it.
#[derive(Clone)]
pub(crate) struct Keys {
    token: String,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(<redacted>)")
    }
}

/// A valid sign-in, as read from the cookie.
#[derive(Debug, Clone)]
pub(crate) struct Session {
    /// The cookie's value (what the CSRF token is bound to).
    pub(crate) cookie: String,
    /// Who signed in (the name given at sign-in), for the audit rows.
    pub(crate) actor: String,
    /// The cookie's nonce: what sign-out revokes.
    pub(crate) nonce: String,
    /// When the cookie expires, Unix ms.
    pub(crate) expiry: i64,
}

impl Keys {
    pub(crate) fn new(token: &str) -> Self {
        Self {
            token: token.to_owned(),
        }
    }

    fn mac(&self, parts: &[&str]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(self.token.as_bytes()).expect("HMAC takes any key length");
        for (i, p) in parts.iter().enumerate() {
            if i > 0 {
                mac.update(b"|");
            }
            mac.update(p.as_bytes());
        }
        mac
    }

    /// `true` when `candidate` is the admin token (compared in constant time, through the
    /// MAC of both).
    pub(crate) fn is_token(&self, candidate: &str) -> bool {
        let expected = self.mac(&["token", &self.token]).finalize().into_bytes();
        self.mac(&["token", candidate])
            .verify_slice(&expected)
            .is_ok()
    }

    /// A new session cookie value for `actor`, valid until `now_ms` + [`SESSION_MS`].
    pub(crate) fn issue(&self, actor: &str, now_ms: i64) -> String {
        let expiry = (now_ms + SESSION_MS).to_string();
        let actor = URL_SAFE_NO_PAD.encode(actor.as_bytes());
        let nonce = uuid::Uuid::new_v4().simple().to_string();
        let mac = self
            .mac(&["session", &expiry, &actor, &nonce])
            .finalize()
            .into_bytes();
        format!("{expiry}.{actor}.{nonce}.{}", URL_SAFE_NO_PAD.encode(mac))
    }

    /// The session of cookie value `value`, when its MAC holds and it has not expired.
    pub(crate) fn verify(&self, value: &str, now_ms: i64) -> Option<Session> {
        let mut parts = value.split('.');
        let (expiry, actor, nonce, mac) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let mac = URL_SAFE_NO_PAD.decode(mac).ok()?;
        self.mac(&["session", expiry, actor, nonce])
            .verify_slice(&mac)
            .ok()?;
        let expiry = expiry.parse::<i64>().ok()?;
        if expiry <= now_ms {
            return None;
        }
        let actor = String::from_utf8(URL_SAFE_NO_PAD.decode(actor).ok()?).ok()?;
        Some(Session {
            cookie: value.to_owned(),
            actor,
            nonce: nonce.to_owned(),
            expiry,
        })
    }

    /// The CSRF token of `session`.
    pub(crate) fn csrf(&self, session: &Session) -> String {
        URL_SAFE_NO_PAD.encode(self.mac(&["csrf", &session.cookie]).finalize().into_bytes())
    }

    /// `true` when `token` is `session`'s CSRF token (constant time).
    pub(crate) fn csrf_holds(&self, session: &Session, token: &str) -> bool {
        URL_SAFE_NO_PAD.decode(token).is_ok_and(|t| {
            self.mac(&["csrf", &session.cookie])
                .verify_slice(&t)
                .is_ok()
        })
    }
}

/// Records `session` as signed out (table `console_revoked_sessions`), so every instance
/// refuses its cookie from now on; rows of cookies expired by `now_ms` go at the same time.
///
/// # Errors
/// [`StoreError`] when the database fails.
pub(crate) async fn revoke(
    db: &Database,
    session: &Session,
    now_ms: i64,
) -> Result<(), StoreError> {
    let mut tx = db.begin().await?;
    tx.execute(query("DELETE FROM console_revoked_sessions WHERE expires_at <= $1").bind(now_ms))
        .await?;
    // Signing out twice (two tabs) revokes once.
    tx.insert_ignoring_duplicate(
        query(
            "INSERT INTO console_revoked_sessions (nonce, expires_at, revoked_at) \
             VALUES ($1, $2, $3)",
        )
        .bind(session.nonce.as_str())
        .bind(session.expiry)
        .bind(now_ms),
        "(nonce)",
    )
    .await?;
    tx.commit().await
}

/// `true` when `session` was signed out ([`revoke`]).
///
/// # Errors
/// [`StoreError`] when the database fails.
pub(crate) async fn is_revoked(db: &Database, session: &Session) -> Result<bool, StoreError> {
    #[derive(sqlx::FromRow)]
    struct Count {
        n: i64,
    }
    let row: Option<Count> = db
        .fetch_optional(
            query("SELECT COUNT(*) AS n FROM console_revoked_sessions WHERE nonce = $1")
                .bind(session.nonce.as_str()),
        )
        .await?;
    Ok(row.is_some_and(|r| r.n > 0))
}

/// The value of cookie `name` in a `Cookie` header (RFC 6265 §5.4: `a=1; b=2`).
pub(crate) fn cookie<'h>(header: &'h str, name: &str) -> Option<&'h str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

/// The `Set-Cookie` value that stores `value` as the session.
pub(crate) fn set_cookie(value: &str) -> String {
    format!(
        "{COOKIE}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={}",
        SESSION_MS / 1000
    )
}

/// The `Set-Cookie` value that ends the session.
pub(crate) fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/console; HttpOnly; SameSite=Strict; Max-Age=0")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_and_its_csrf_token_verify_and_forgeries_do_not() {
        let keys = Keys::new("admin-token-0123456789");
        let cookie = keys.issue("ops", 1_000);
        let s = keys.verify(&cookie, 2_000).expect("valid");
        assert_eq!(s.actor, "ops");
        assert!(
            keys.verify(&cookie, 1_000 + SESSION_MS).is_none(),
            "expired"
        );
        let other = Keys::new("another-token-0123456789");
        assert!(
            other.verify(&cookie, 2_000).is_none(),
            "another token's MAC"
        );
        let tampered = cookie.replacen('.', "9.", 1);
        assert!(keys.verify(&tampered, 2_000).is_none());
        let csrf = keys.csrf(&s);
        assert!(keys.csrf_holds(&s, &csrf));
        let s2 = keys.verify(&keys.issue("ops", 1_000), 2_000).unwrap();
        assert!(!keys.csrf_holds(&s2, &csrf), "bound to its session");
        assert!(!keys.csrf_holds(&s, ""));
        assert!(keys.is_token("admin-token-0123456789"));
        assert!(!keys.is_token("admin-token-012345678"));
        assert_eq!(cookie_of("a=1; oncely_console=x.y; b=2"), Some("x.y"));
    }

    fn cookie_of(h: &str) -> Option<&str> {
        cookie(h, COOKIE)
    }
}
