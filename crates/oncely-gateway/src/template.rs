//! The URL template of a route's status probe: `/orders?external_ref={/external_ref}`, with
//! `{key}` for the `Idempotency-Key` and `{/pointer}` for a field of the request body.
//!
//! Its own module so that the configuration can check a template without depending on the
//! probe that runs it.

use oncely_http::status_url;
use serde_json::Value;

/// One piece of a probe URL template.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Piece {
    Text(String),
    /// `{key}`: the `Idempotency-Key`.
    Key,
    /// `{/a/b}`: a JSON pointer (RFC 6901) into the request body.
    Pointer(String),
}

/// A parsed probe URL template (`/orders?external_ref={/external_ref}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Template(Vec<Piece>);

impl Template {
    /// Parses `text`: a path starting with `/`, placeholders `{key}` and `{/pointer}`.
    ///
    /// # Errors
    /// Why it is not one.
    pub(crate) fn parse(text: &str) -> Result<Self, &'static str> {
        if !text.starts_with('/') {
            return Err("it must be a path starting with /");
        }
        let mut pieces = Vec::new();
        let mut rest = text;
        while let Some(open) = rest.find('{') {
            let close = rest[open..].find('}').ok_or("a { is not closed")? + open;
            pieces.push(Piece::Text(rest[..open].to_owned()));
            let inner = &rest[open + 1..close];
            pieces.push(match inner {
                "key" => Piece::Key,
                p if p.starts_with('/') => Piece::Pointer(p.to_owned()),
                _ => return Err("a placeholder is {key} or {/json/pointer}"),
            });
            rest = &rest[close + 1..];
        }
        if rest.contains('}') {
            return Err("a } is not opened");
        }
        pieces.push(Piece::Text(rest.to_owned()));
        Ok(Self(pieces))
    }

    /// The path and query for `key` and the request `body`, every value percent-encoded.
    ///
    /// # Errors
    /// Why it cannot be built: the body is not JSON, or has no scalar at a pointer.
    pub(crate) fn render(&self, key: &str, body: &[u8]) -> Result<String, String> {
        let mut json: Option<Value> = None;
        let mut out = String::new();
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => out.push_str(t),
                // The one encoding of a value in a link: oncely-http's status URL.
                Piece::Key => out.push_str(&status_url("{key}", key)),
                Piece::Pointer(p) => {
                    if json.is_none() {
                        json = Some(
                            serde_json::from_slice(body)
                                .map_err(|_| "the request body is not JSON".to_owned())?,
                        );
                    }
                    let value = match json.as_ref().and_then(|j| j.pointer(p)) {
                        Some(Value::String(s)) => s.clone(),
                        Some(v @ (Value::Number(_) | Value::Bool(_))) => v.to_string(),
                        _ => return Err(format!("the request body has no scalar at {p}")),
                    };
                    out.push_str(&status_url("{key}", &value));
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_template_renders_the_key_and_body_fields_percent_encoded() {
        let t = Template::parse("/orders?ref={/ref}&k={key}&n={/n}").unwrap();
        let body = br#"{"ref":"a b/c","n":7}"#;
        assert_eq!(
            t.render("k/1", body).unwrap(),
            "/orders?ref=a%20b%2Fc&k=k%2F1&n=7"
        );
        assert!(t.render("k", b"{}").is_err());
        assert!(Template::parse("orders").is_err());
        assert!(Template::parse("/o?{x}").is_err());
        assert!(Template::parse("/o?{/x").is_err());
    }
}
